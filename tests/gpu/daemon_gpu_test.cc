// The daemon's GPU backend end to end: W ulyssesd processes on the GPUs present (sharing one GPU
// when W exceeds them) and real clients, every result checked bit for bit against the index
// semantics. Skips without a CUDA device.
#include <cuda.h>
#include <cuda_runtime_api.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <optional>
#include <thread>
#include <type_traits>

#include "cluster_util.h"
#include "phase_args.h"
#include "gtest/gtest.h"
#include "gpu_workload.h"
#include "ulysses/client/client.h"
#include "ulysses/common/session_layout.h"
#include "ulysses/common/strings.h"
#include "ulysses/ipc/cuda_memory.h"
#include "ulysses/ipc/shm.h"

namespace ulysses {
namespace {

// What the daemons of a 2-rank session count around `calls` ScatterHeads calls with out= per
// rank, through the rings or (use_rings false) each a Control.Call RPC: each counter before
// the first call, after it (a row count's first call may allocate) and after the last.
struct CallCounts {
  std::string error;
  uint64_t device_before = 0, device_first = 0, device_last = 0;  // device allocations
  uint64_t ring_before = 0, ring_first = 0, ring_last = 0;  // the ring path's host allocations
  uint64_t grpc_before = 0, grpc_first = 0, grpc_last = 0;  // the Control.Call handler's
};

class GpuCluster : public testing_util::ClusterTest {
 protected:
  void SetUp() override {
    if (ipc::cuda::DeviceCount() == 0) GTEST_SKIP() << "no CUDA device";
    backend_ = "nvlink";
  }

  std::vector<CallCounts> CountScatterCalls(bool use_rings, int calls) {
    std::vector<CallCounts> counts(2);
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        CallCounts& n = counts[r];
        client::ConnectOptions options{Members(2)[r], "alloc"};
        options.use_rings = use_rings;
        auto client = client::Client::Connect(options);
        if (!client.ok()) return void(n.error = client.status().ToString());
        auto group = (*client)->JoinGroup({"alloc", 2, r, Members(2), "nvlink", 0});
        if (!group.ok()) return void(n.error = group.status().ToString());
        auto session = (*client)->CreateSession(*group, {8, 128, DType::kBFloat16, 256, 2, {}, 0});
        if (!session.ok()) return void(n.error = session.status().ToString());
        auto x = (*client)->AllocBuffer(256 * 8 * 128 * 2, "x");
        auto out = (*client)->AllocBuffer(2 * 256 * 4 * 128 * 2, "out");
        if (!x.ok() || !out.ok()) return void(n.error = "alloc");
        Count(r, &n.device_before, &n.ring_before, &n.grpc_before);
        for (int i = 0; i < calls; ++i) {
          auto res = (*session)->ScatterHeads(x->Ref(), 1, 256, out->Ref());
          if (!res.ok()) return void(n.error = res.status().ToString());
          if (i == 0) Count(r, &n.device_first, &n.ring_first, &n.grpc_first);
        }
        Count(r, &n.device_last, &n.ring_last, &n.grpc_last);
      });
    }
    for (auto& t : threads) t.join();
    return counts;
  }
  void Count(int rank, uint64_t* device, uint64_t* ring, uint64_t* grpc) {
    const v1::DaemonState st = State(rank);
    *device = st.device_allocations();
    *ring = st.call_path_host_allocations();
    *grpc = st.grpc_call_host_allocations();
  }

  // A client of the one daemon started, in a group `name` of its own.
  struct Alone {
    std::unique_ptr<client::Client> client;
    std::optional<client::Group> group;
  };
  void JoinAlone(const std::string& name, Alone* out) {
    auto c = client::Client::Connect({Members(1)[0], name});
    ASSERT_TRUE(c.ok()) << c.status();
    auto g = (*c)->JoinGroup({name, 1, 0, Members(1), "nvlink", 0});
    ASSERT_TRUE(g.ok()) << g.status();
    out->client = std::move(*c);
    out->group = std::move(*g);
  }

  // Whether daemon `daemon` shows `slot` of session `session_id` as `state` within 5 s (the
  // ring worker takes a submitted call in microseconds; this only bounds a failure).
  bool SlotReaches(int daemon, uint64_t session_id, int slot, const std::string& state) {
    for (int i = 0; i < 1000; ++i) {
      v1::ListSlotsResponse slots;
      grpc::ClientContext ctx;
      if (!Admin(daemon)->ListSlots(&ctx, {}, &slots).ok()) return false;
      for (const v1::SlotState& s : slots.slots())
        if (s.session_id() == session_id && s.slot() == slot && s.state() == state) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    return false;
  }

  // One client per rank of the 2 daemons started, a group `group` of both and a session of
  // `spec` in it, made collectively.
  struct TwoRanks {
    std::unique_ptr<client::Client> c0, c1;
    std::optional<client::Group> g0, g1;
    std::unique_ptr<client::Session> s0, s1;
  };
  void OpenTwoRanks(const std::string& group, const std::string& name0, const std::string& name1,
                    const client::SessionSpec& spec, TwoRanks* out) {
    auto c0 = client::Client::Connect({Members(2)[0], name0});
    auto c1 = client::Client::Connect({Members(2)[1], name1});
    ASSERT_TRUE(c0.ok() && c1.ok());
    absl::StatusOr<client::Group> g0, g1;
    std::thread j([&] { g1 = (*c1)->JoinGroup({group, 2, 1, Members(2), "nvlink", 0}); });
    g0 = (*c0)->JoinGroup({group, 2, 0, Members(2), "nvlink", 0});
    j.join();
    ASSERT_TRUE(g0.ok() && g1.ok()) << g0.status() << " " << g1.status();
    absl::StatusOr<std::unique_ptr<client::Session>> s0, s1;
    std::thread cs([&] { s1 = (*c1)->CreateSession(*g1, spec); });
    s0 = (*c0)->CreateSession(*g0, spec);
    cs.join();
    ASSERT_TRUE(s0.ok() && s1.ok()) << s0.status() << " " << s1.status();
    out->c0 = std::move(*c0);
    out->c1 = std::move(*c1);
    out->g0 = std::move(*g0);
    out->g1 = std::move(*g1);
    out->s0 = std::move(*s0);
    out->s1 = std::move(*s1);
  }
};

using testing_util::WorkloadShape;

// A one-rank session's call on `s`, whose input `in` the caller filled with `host`: the result
// is the input (a one-rank scatter_heads is the identity). "" or what went wrong.
std::string IdentityScatter(client::Session& s, const client::Buffer& in,
                            const std::vector<uint16_t>& host, int rows) {
  auto res = s.ScatterHeads(in.Ref(), 1, rows);
  if (!res.ok()) return res.status().ToString();
  std::vector<uint16_t> back(host.size());
  if (cudaMemcpy(back.data(), res->data, back.size() * 2, cudaMemcpyDeviceToHost) != cudaSuccess)
    return "cudaMemcpy of the result";
  if (std::memcmp(back.data(), host.data(), host.size() * 2) != 0) return "the result differs";
  return res->Release().ok() ? "" : "release";
}

// The free memory of `device` (the whole GPU's: the test needs it to itself).
size_t DeviceFreeBytes(int device) {
  int was = 0;
  EXPECT_EQ(cudaGetDevice(&was), cudaSuccess);
  EXPECT_EQ(cudaSetDevice(device), cudaSuccess);
  size_t free = 0, total = 0;
  EXPECT_EQ(cudaMemGetInfo(&free, &total), cudaSuccess);
  EXPECT_EQ(cudaSetDevice(was), cudaSuccess);
  return free;
}

// A client's one-rank session of [64, 8, 64] bf16 on one daemon, its input filled: Call runs
// a scatter_heads on it and checks the result.
struct Bystander {
  static constexpr int kRows = 64;
  std::vector<uint16_t> host;
  std::unique_ptr<client::Client> client;
  std::unique_ptr<client::Session> session;
  std::optional<client::Buffer> in;
  std::string Call() { return IdentityScatter(*session, *in, host, kRows); }
};
// Opens `b` on the daemon at `socket`, its client and group named `name`.
void OpenBystander(const std::string& socket, const std::string& name, Bystander* b) {
  b->host.resize(Bystander::kRows * 8 * 64);
  for (size_t i = 0; i < b->host.size(); ++i)
    b->host[i] = static_cast<uint16_t>(i * 2654435761u >> 16);
  auto c = client::Client::Connect({socket, name});
  ASSERT_TRUE(c.ok()) << c.status();
  auto g = (*c)->JoinGroup({name, 1, 0, {socket}, "nvlink", 0});
  ASSERT_TRUE(g.ok()) << g.status();
  auto s = (*c)->CreateSession(*g, {8, 64, DType::kBFloat16, Bystander::kRows, 2, {}, 0});
  ASSERT_TRUE(s.ok()) << s.status();
  auto in = (*c)->AllocBuffer(b->host.size() * 2, "x");
  ASSERT_TRUE(in.ok()) << in.status();
  ASSERT_EQ(cudaMemcpy(in->data, b->host.data(), b->host.size() * 2, cudaMemcpyHostToDevice),
            cudaSuccess);
  b->client = std::move(*c);
  b->session = std::move(*s);
  b->in = *in;
}

class GpuSemantics : public GpuCluster, public testing::WithParamInterface<WorkloadShape> {};

// The demo's workload on device memory (gpu_workload.h).
TEST_P(GpuSemantics, EveryOpBitExact) {
  Start(GetParam().world);
  testing_util::RunWorkloadOnEveryRank(Members(GetParam().world), GetParam(), "nvlink");
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GpuSemantics,
    testing::Values(WorkloadShape{1, 1, 64, 8, 128, DType::kBFloat16, {}},
                    WorkloadShape{2, 2, 200, 14, 128, DType::kBFloat16, {2, 10, 2}},
                    WorkloadShape{2, 1, 33, 6, 64, DType::kFloat16, {1, 4, 1}},
                    WorkloadShape{4, 2, 17, 28, 128, DType::kBFloat16, {7, 14, 7}},
                    WorkloadShape{4, 1, 9, 3, 3, DType::kFloat32, {1, 1, 1}},   // scalar path, odd D
                    WorkloadShape{8, 1, 16, 4, 128, DType::kBFloat16, {1, 2, 1}},
                    WorkloadShape{8, 2, 5, 2, 96, DType::kFloat32, {2}}),
    testing_util::WorkloadName);

// Device tensors from cudaMalloc handed over by CUDA IPC; a freed and re-made allocation at the
// same address must be registered afresh, never confused with the old one: whether the client
// freed the old registration first (rounds 1 and 2 register after their predecessor's was
// freed) or not (round 2's is left registered when its memory is freed: round 3's registration
// finds it stale by the allocation's identity and frees it).
TEST_F(GpuCluster, IpcTensorsAndReallocationAtTheSameAddress) {
  Start(1);
  Alone a;
  ASSERT_NO_FATAL_FAILURE(JoinAlone("ipc", &a));
  client::Client* client = a.client.get();
  const int H = 8, D = 64, S = 32;
  auto session = client->CreateSession(*a.group, {H, D, DType::kFloat32, S, 2, {}, 0});
  ASSERT_TRUE(session.ok()) << session.status();
  const size_t n = static_cast<size_t>(S) * H * D;
  std::vector<float> host(n), got(n);
  // The daemon's IPC mappings of the client's tensors: one open per registered buffer, closed
  // by its FreeBuffer, and by the client's end for one never freed.
  const uint64_t mappings = State(0).device_mappings_open();
  void* first = nullptr;
  uint64_t stale_id = 0;
  for (int round = 0; round < 4; ++round) {
    void* dev = nullptr;
    ASSERT_EQ(cudaMalloc(&dev, n * sizeof(float)), cudaSuccess);
    if (round == 0) first = dev;
    // The case this test is for: the driver gives the freed address to the new allocation.
    // Round 3's predecessor was freed while the daemon still had it open, which CUDA may keep
    // from reuse: then the stale registration is not at the new address, and only the result
    // is checked.
    const bool reused = dev == first;
    if (round < 3) {
      ASSERT_TRUE(reused) << "round " << round << ": the new allocation is elsewhere";
    }
    if (round == 3 && !reused) {
      std::cout << "round 3: the driver did not give the address of memory still open in the "
                   "daemon back; the stale-registration case did not happen\n";
      RecordProperty("stale_registration_case", "did not happen");
    }
    for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(round * 1000003 + i);
    ASSERT_EQ(cudaMemcpy(dev, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    auto buf = client->RegisterDeviceBuffer(dev, n * sizeof(float), "x");
    ASSERT_TRUE(buf.ok()) << buf.status();
    // Round 2's registration, where the client library did not find it stale (a new
    // allocation that overlaps none of it).
    const bool stale_held = round == 3 && client->HoldsBuffer(stale_id);
    if (round == 3) {
      EXPECT_NE(buf->id, stale_id) << "a new allocation: a new registration";
      if (reused) {
        EXPECT_FALSE(stale_held) << "the stale registration is freed";
      }
    }
    auto res = (*session)->ScatterHeads(buf->Ref(), 1, S);
    ASSERT_TRUE(res.ok()) << res.status();
    EXPECT_TRUE(res->device);
    ASSERT_EQ(cudaMemcpy(got.data(), res->data, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    // W = 1: the scatter is the identity on [B, S, H, D].
    EXPECT_EQ(std::memcmp(got.data(), host.data(), n * sizeof(float)), 0) << "round " << round;
    ASSERT_TRUE(res->Release().ok());
    EXPECT_EQ(State(0).device_mappings_open(), mappings + 1 + (stale_held ? 1 : 0))
        << "round " << round;
    if (round == 2) {
      stale_id = buf->id;  // freed by the client library when the next round registers
    } else {
      ASSERT_TRUE(client->FreeBuffer(buf->id).ok());
      if (stale_held) {
        ASSERT_TRUE(client->FreeBuffer(stale_id).ok());
      }
      EXPECT_TRUE(
          testing_util::Eventually([&] { return State(0).device_mappings_open() == mappings; }))
          << "round " << round << ": " << State(0).device_mappings_open() << " mappings open";
    }
    ASSERT_EQ(cudaFree(dev), cudaSuccess);  // the next round's cudaMalloc reuses the address
  }
  void* kept = nullptr;
  ASSERT_EQ(cudaMalloc(&kept, n * sizeof(float)), cudaSuccess);
  auto held = client->RegisterDeviceBuffer(kept, n * sizeof(float), "kept");
  ASSERT_TRUE(held.ok()) << held.status();
  EXPECT_EQ(State(0).device_mappings_open(), mappings + 1);
  session->reset();
  a.client.reset();  // the client ends with its buffer registered
  EXPECT_TRUE(testing_util::Eventually([&] { return State(0).device_mappings_open() == mappings; }))
      << State(0).device_mappings_open() << " mappings open after the client ended";
  ASSERT_EQ(cudaFree(kept), cudaSuccess);
}

// The daemon reports whether it shares the GPU through MPS (GetState's mps_mode), as the one
// who started the daemons knows it: ULYSSES_TEST_EXPECT_MPS is "mps" or "no-mps" there.
TEST_F(GpuCluster, ReportsWhetherItRunsUnderMps) {
  const char* expect = std::getenv("ULYSSES_TEST_EXPECT_MPS");
  if (expect == nullptr || *expect == '\0')
    GTEST_SKIP() << "ULYSSES_TEST_EXPECT_MPS does not say whether MPS runs here";
  Start(1);
  EXPECT_EQ(State(0).mps_mode(), expect);
}

// A client frees memory it registered by CUDA IPC handle while the daemon holds it open, makes
// new allocations of the same size (which may take the freed pages), and calls on the freed
// buffers: reading x from one, writing out= into the other. What the client gets back is its
// own affair; what must hold is that the daemon stays healthy, that another client's session
// still gets its exact results, and that the client's new allocations, which may now own the
// freed pages, are not written by the daemon. (CUDA leaves the exporter's free while an
// importer holds the handle open unspecified; this case finds out what this driver does.)
TEST_F(GpuCluster, AnIpcBufferFreedByItsClientWhileRegisteredHarmsNoOtherMemory) {
  Start(1);
  Alone a, b;
  ASSERT_NO_FATAL_FAILURE(JoinAlone("freer", &a));
  ASSERT_NO_FATAL_FAILURE(JoinAlone("bystander", &b));
  const int H = 8, D = 64, S = 32;
  const size_t n = static_cast<size_t>(S) * H * D, bytes = n * sizeof(float);
  auto sa = a.client->CreateSession(*a.group, {H, D, DType::kFloat32, S, 2, {}, 0});
  auto sb = b.client->CreateSession(*b.group, {H, D, DType::kFloat32, S, 2, {}, 0});
  ASSERT_TRUE(sa.ok() && sb.ok());
  std::vector<float> host(n), got(n);
  for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i);
  void* x = nullptr;
  void* y = nullptr;
  ASSERT_EQ(cudaMalloc(&x, bytes), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&y, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(x, host.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  auto xb = a.client->RegisterDeviceBuffer(x, bytes, "x");
  auto yb = a.client->RegisterDeviceBuffer(y, bytes, "y");
  ASSERT_TRUE(xb.ok() && yb.ok());
  ASSERT_EQ(cudaFree(x), cudaSuccess);
  ASSERT_EQ(cudaFree(y), cudaSuccess);
  // New allocations of the same size, filled with a pattern the daemon's writes would break.
  constexpr int kFresh = 8;
  std::vector<void*> fresh(kFresh, nullptr);
  for (void*& f : fresh) {
    ASSERT_EQ(cudaMalloc(&f, bytes), cudaSuccess);
    ASSERT_EQ(cudaMemset(f, 0x5a, bytes), cudaSuccess);
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  auto freed_call = (*sa)->ScatterHeads(xb->Ref(), 1, S, yb->Ref());
  std::cout << "a call on the freed buffers: " << freed_call.status() << "\n";
  // The other client is served, bit for bit.
  void* bx = nullptr;
  ASSERT_EQ(cudaMalloc(&bx, bytes), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(bx, host.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
  auto bb = b.client->RegisterDeviceBuffer(bx, bytes, "bx");
  ASSERT_TRUE(bb.ok()) << bb.status();
  auto res = (*sb)->ScatterHeads(bb->Ref(), 1, S);
  ASSERT_TRUE(res.ok()) << res.status();
  ASSERT_EQ(cudaMemcpy(got.data(), res->data, bytes, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(std::memcmp(got.data(), host.data(), bytes), 0);
  ASSERT_TRUE(res->Release().ok());
  EXPECT_EQ(State(0).health(), "SERVING");
  // None of the new allocations was written.
  std::vector<uint8_t> back(bytes);
  for (int i = 0; i < kFresh; ++i) {
    ASSERT_EQ(cudaMemcpy(back.data(), fresh[i], bytes, cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(std::count(back.begin(), back.end(), uint8_t{0x5a}), static_cast<ptrdiff_t>(bytes))
        << "allocation " << i << " made after the free was written";
    ASSERT_EQ(cudaFree(fresh[i]), cudaSuccess);
  }
  ASSERT_EQ(cudaFree(bx), cudaSuccess);
}

// Device memory of several CUDA VMM allocations mapped back to back, as torch's expandable
// segments make it: a tensor over three of them is handed over as their fds, a second call on
// it costs no new registration, and a piece unmapped and replaced at the same address is
// registered afresh, so the call reads the new memory, never the old one.
// The driver's VMM calls, through the runtime's entry points (the test links no libcuda, so
// that it starts on machines without a driver and skips there).
struct VmmDriver {
  decltype(&::cuMemCreate) MemCreate = nullptr;
  decltype(&::cuMemRelease) MemRelease = nullptr;
  decltype(&::cuMemAddressReserve) AddressReserve = nullptr;
  decltype(&::cuMemAddressFree) AddressFree = nullptr;
  decltype(&::cuMemMap) Map = nullptr;
  decltype(&::cuMemUnmap) Unmap = nullptr;
  decltype(&::cuMemSetAccess) SetAccess = nullptr;
  decltype(&::cuMemGetAddressRange) AddressRange = nullptr;
  decltype(&::cuMemRetainAllocationHandle) RetainHandle = nullptr;
  static const VmmDriver& Get() {
    static const VmmDriver d = [] {
      VmmDriver v;
      auto r = [](const char* name, auto* fn) {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult q{};
        if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &q) ==
                cudaSuccess &&
            q == cudaDriverEntryPointSuccess)
          *fn = reinterpret_cast<std::remove_pointer_t<decltype(fn)>>(p);
      };
      r("cuMemCreate", &v.MemCreate);
      r("cuMemRelease", &v.MemRelease);
      r("cuMemAddressReserve", &v.AddressReserve);
      r("cuMemAddressFree", &v.AddressFree);
      r("cuMemMap", &v.Map);
      r("cuMemUnmap", &v.Unmap);
      r("cuMemSetAccess", &v.SetAccess);
      r("cuMemGetAddressRange", &v.AddressRange);
      r("cuMemRetainAllocationHandle", &v.RetainHandle);
      return v;
    }();
    return d;
  }
  bool ok() const {
    return MemCreate && MemRelease && AddressReserve && AddressFree && Map && Unmap && SetAccess &&
           AddressRange && RetainHandle;
  }
};

class VmmPieces {
 public:
  static constexpr int kPieces = 3;
  explicit VmmPieces(uint64_t granularity) : g_(granularity) {
    prop_.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop_.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop_.location.id = 0;
    prop_.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    EXPECT_EQ(VmmDriver::Get().AddressReserve(&base_, kPieces * g_, 0, 0, 0), CUDA_SUCCESS);
    for (int i = 0; i < kPieces; ++i) Map(i);
  }
  ~VmmPieces() {
    for (int i = 0; i < kPieces; ++i) Unmap(i);
    VmmDriver::Get().AddressFree(base_, kPieces * g_);
  }
  // Replaces piece i by a new allocation at the same address.
  void Remap(int i) {
    Unmap(i);
    Map(i);
  }
  uint8_t* at(uint64_t offset) const { return reinterpret_cast<uint8_t*>(base_ + offset); }

 private:
  void Map(int i) {
    ASSERT_EQ(VmmDriver::Get().MemCreate(&handles_[i], g_, &prop_, 0), CUDA_SUCCESS);
    ASSERT_EQ(VmmDriver::Get().Map(base_ + i * g_, g_, 0, handles_[i], 0), CUDA_SUCCESS);
    CUmemAccessDesc access{};
    access.location = prop_.location;
    access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    ASSERT_EQ(VmmDriver::Get().SetAccess(base_ + i * g_, g_, &access, 1), CUDA_SUCCESS);
  }
  void Unmap(int i) {
    if (handles_[i] == 0) return;
    VmmDriver::Get().Unmap(base_ + i * g_, g_);
    VmmDriver::Get().MemRelease(handles_[i]);
    handles_[i] = 0;
  }
  uint64_t g_;
  CUmemAllocationProp prop_{};
  CUdeviceptr base_ = 0;
  CUmemGenericAllocationHandle handles_[kPieces] = {};
};

TEST_F(GpuCluster, VmmTensorsOverSeveralMappingsAndAPieceMappedAgain) {
  ASSERT_TRUE(VmmDriver::Get().ok()) << "the driver lacks the VMM entry points";
  Start(1);
  auto client = client::Client::Connect({Members(1)[0], "vmm"});
  ASSERT_TRUE(client.ok()) << client.status();
  auto group = (*client)->JoinGroup({"vmm", 1, 0, Members(1), "nvlink", 0});
  ASSERT_TRUE(group.ok()) << group.status();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  absl::StatusOr<uint64_t> g = ipc::cuda::VmmMapping::Granularity(0);
  ASSERT_TRUE(g.ok()) << g.status();
  // A float32 tensor of 2g bytes from g/2 on: it lies over all three pieces.
  const int H = 8, D = 64;
  const int S = static_cast<int>(2 * *g / (H * D * sizeof(float)));
  auto session = (*client)->CreateSession(*group, {H, D, DType::kFloat32, S, 2, {}, 0});
  ASSERT_TRUE(session.ok()) << session.status();
  const size_t n = static_cast<size_t>(S) * H * D;
  VmmPieces pieces(*g);
  uint8_t* x = pieces.at(*g / 2);
  std::vector<float> host(n), got(n);
  uint64_t first_id = 0;
  for (int round = 0; round < 3; ++round) {
    if (round == 2) pieces.Remap(1);
    for (size_t i = 0; i < n; ++i) host[i] = static_cast<float>(round * 1000003 + i);
    ASSERT_EQ(cudaMemcpy(x, host.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    auto buf = (*client)->RegisterDeviceBuffer(x, n * sizeof(float), "x", 0);
    ASSERT_TRUE(buf.ok()) << buf.status();
    EXPECT_EQ(buf->registration_size, 3 * *g) << "the three whole mappings";
    EXPECT_EQ(buf->base_offset, *g / 2);
    if (round == 0) first_id = buf->id;
    if (round == 1) {
      EXPECT_EQ(buf->id, first_id) << "the same mappings: the registration is kept";
    }
    if (round == 2) {
      EXPECT_NE(buf->id, first_id) << "a piece mapped again: registered afresh";
      EXPECT_FALSE((*client)->HoldsBuffer(first_id)) << "the stale registration is freed";
    }
    auto res = (*session)->ScatterHeads(buf->Ref(), 1, S);
    ASSERT_TRUE(res.ok()) << res.status();
    ASSERT_EQ(cudaMemcpy(got.data(), res->data, n * sizeof(float), cudaMemcpyDeviceToHost),
              cudaSuccess);
    // W = 1: the scatter is the identity on [B, S, H, D].
    EXPECT_EQ(std::memcmp(got.data(), host.data(), n * sizeof(float)), 0) << "round " << round;
    ASSERT_TRUE(res->Release().ok());
  }
  // A tensor inside the last piece alone: a registration of its own, beside the first.
  auto whole = (*client)->RegisterDeviceBuffer(x, n * sizeof(float), "x", 0);
  ASSERT_TRUE(whole.ok()) << whole.status();
  const uint64_t held = whole->id;
  auto tail = (*client)->RegisterDeviceBuffer(pieces.at(2 * *g + 64), 4096, "tail", 0);
  ASSERT_TRUE(tail.ok()) << tail.status();
  EXPECT_NE(tail->id, held);
  EXPECT_EQ(tail->registration_size, *g);
  EXPECT_TRUE((*client)->HoldsBuffer(held)) << "a neighbour's registration stays";

  // An allocation that cannot be shared as a POSIX fd is refused, naming what it needs.
  CUmemAllocationProp plain{};
  plain.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  plain.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  plain.location.id = 0;
  CUmemGenericAllocationHandle h = 0;
  CUdeviceptr p = 0;
  ASSERT_EQ(VmmDriver::Get().MemCreate(&h, *g, &plain, 0), CUDA_SUCCESS);
  ASSERT_EQ(VmmDriver::Get().AddressReserve(&p, *g, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(VmmDriver::Get().Map(p, *g, 0, h, 0), CUDA_SUCCESS);
  CUmemAccessDesc access{};
  access.location = plain.location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_EQ(VmmDriver::Get().SetAccess(p, *g, &access, 1), CUDA_SUCCESS);
  auto refused = (*client)->RegisterDeviceBuffer(reinterpret_cast<void*>(p), 4096, "plain", 0);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_NE(refused.status().message().find("POSIX file descriptor"), std::string::npos)
      << refused.status();
  VmmDriver::Get().Unmap(p, *g);
  VmmDriver::Get().MemRelease(h);
  VmmDriver::Get().AddressFree(p, *g);
}

// A held result is never overwritten: poison fills only free slots, and the next call that
// needs the held slot waits for its release.
TEST_F(GpuCluster, HeldSlotIsNeverOverwrittenAndOutCopiesToStridedView) {
  Start(2);
  std::vector<std::thread> threads;
  std::vector<std::string> errors(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      auto fail = [&](const std::string& e) { errors[r] = e; };
      auto client = client::Client::Connect({Members(2)[r], "held"});
      if (!client.ok()) return fail(client.status().ToString());
      auto group = (*client)->JoinGroup({"held", 2, r, Members(2), "nvlink", 0});
      if (!group.ok()) return fail(group.status().ToString());
      const int H = 4, D = 32, S = 8, HL = H / 2;
      auto session = (*client)->CreateSession(*group, {H, D, DType::kFloat32, S, 2, {}, 0});
      if (!session.ok()) return fail(session.status().ToString());
      const size_t n = static_cast<size_t>(S) * H * D;
      auto x = (*client)->AllocBuffer(n * 4, "x");
      auto out = (*client)->AllocBuffer(2 * n * 4, "out");  // room for a strided view
      if (!x.ok() || !out.ok()) return fail("alloc");
      std::vector<float> xh(n);
      for (size_t i = 0; i < n; ++i) xh[i] = static_cast<float>(r * 100000 + i);
      if (!ipc::cuda::Copy(x->data, xh.data(), n * 4).ok()) return fail("upload");
      auto first = (*session)->ScatterHeads(x->Ref(), 1, S);  // held in slot 0
      if (!first.ok()) return fail(first.status().ToString());
      std::vector<float> before(first->bytes / 4), after(first->bytes / 4);
      if (!ipc::cuda::Copy(before.data(), first->data, first->bytes).ok()) return fail("read");
      auto poisoned = (*session)->PoisonSlots();
      if (!poisoned.ok() || *poisoned != 1) return fail("poison did not fill exactly the free slot");
      // out= into a strided view [1, 2S, HL, D] with the token stride doubled.
      const std::array<int64_t, 4> strides{2 * S * HL * D * 2, HL * D * 2, D, 1};
      auto second = (*session)->ScatterHeads(x->Ref(), 1, S, out->Ref(0, strides));
      if (!second.ok()) return fail(second.status().ToString());
      if (!ipc::cuda::Copy(after.data(), first->data, first->bytes).ok()) return fail("read");
      if (std::memcmp(before.data(), after.data(), first->bytes) != 0)
        return fail("the held slot changed");
      std::vector<float> outh(2 * n);
      if (!ipc::cuda::Copy(outh.data(), out->data, 2 * n * 4).ok()) return fail("read out");
      if (std::string bad = testing_util::CheckScatterOut(outh, r, S, H, HL, D, 2 * HL * D);
          !bad.empty())
        return fail(bad);
      if (!first->Release().ok()) return fail("release");
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// Host memory handed to a GPU session is refused before anything runs, naming the operand.
TEST_F(GpuCluster, HostBufferOnGpuBackendIsInvalidArgument) {
  Start(1);
  auto client = client::Client::Connect({Members(1)[0], "kind", absl::Seconds(10), false});
  ASSERT_TRUE(client.ok()) << client.status();
  auto group = (*client)->JoinGroup({"kind", 1, 0, Members(1), "nvlink", 0});
  ASSERT_TRUE(group.ok()) << group.status();
  auto session = (*client)->CreateSession(*group, {4, 32, DType::kFloat32, 8, 2, {}, 0});
  ASSERT_TRUE(session.ok()) << session.status();
  auto fd = ipc::CreateMemfd("host-x", 4 * 32 * 8 * 4);
  ASSERT_TRUE(fd.ok());
  ASSERT_TRUE(ipc::SealSize(fd->get()).ok());
  auto buf = (*client)->RegisterBuffer(fd->get(), "host-x");
  ASSERT_TRUE(buf.ok()) << buf.status();
  auto res = (*session)->ScatterHeads(buf->Ref(), 1, 8);
  ASSERT_FALSE(res.ok());
  EXPECT_EQ(res.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(res.status().message().find("inputs[0]"), std::string::npos) << res.status();
}

// A prepared call allocates nothing: the daemons' device allocation counters and their count
// of the call path's host allocations stay put across calls, and their device memory returns
// to its baseline once the session and client go.
TEST_F(GpuCluster, NoDeviceAllocationPerCallAndMemoryBackToBaseline) {
  Start(2);
  uint64_t baseline[2];
  for (int r = 0; r < 2; ++r) baseline[r] = State(r).device_bytes();
  const std::vector<CallCounts> n = CountScatterCalls(/*use_rings=*/true, 21);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(n[r].error, "") << "rank " << r;
    EXPECT_GT(n[r].device_first, 0u);
    EXPECT_EQ(n[r].device_last, n[r].device_first) << "rank " << r << " allocated during calls";
    EXPECT_TRUE(State(r).host_allocations_counted()) << "rank " << r;
    EXPECT_EQ(n[r].ring_last, n[r].ring_first)
        << "rank " << r << "'s call path allocated host memory";
    EXPECT_EQ(n[r].grpc_last, n[r].grpc_before)
        << "rank " << r << ": ring calls were counted as Control.Call's";
    // The clients are gone: every slot and buffer of theirs is released.
    EXPECT_TRUE(testing_util::Eventually([&] { return State(r).device_bytes() == baseline[r]; }))
        << "rank " << r << ": " << State(r).device_bytes() << " bytes held, baseline "
        << baseline[r];
  }
}

// A GPU session's calls as Control.Call RPCs (the caller waits for each, docs/protocol.md
// section 4.4) allocate on the daemon's host only what gRPC makes per call (4 on the host
// backend, RingTest.CallsOverGrpcAllocateOnlyWhatGrpcMakesPerCall), nothing on the ring
// path's count, and no device memory.
TEST_F(GpuCluster, CallsOverGrpcAllocateOnlyWhatGrpcMakesPerCall) {
  Start(2);
  constexpr int kCalls = 21;
  constexpr uint64_t kGrpcOwnedPerCall = 4;
  const std::vector<CallCounts> n = CountScatterCalls(/*use_rings=*/false, kCalls);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(n[r].error, "") << "rank " << r;
    if (!n[r].error.empty()) continue;
    ASSERT_TRUE(State(r).host_allocations_counted()) << "rank " << r << ": not counted here";
    EXPECT_EQ(n[r].device_last, n[r].device_first) << "rank " << r << " allocated during calls";
    const uint64_t counted = n[r].grpc_last - n[r].grpc_first;
    EXPECT_GT(counted, 0u) << "rank " << r << ": Control.Call's handler is not counted";
    EXPECT_LE(counted, kGrpcOwnedPerCall * (kCalls - 1))
        << "rank " << r << ": " << counted << " allocations in " << kCalls - 1 << " calls";
    EXPECT_EQ(n[r].ring_last, n[r].ring_before)
        << "rank " << r << ": Control.Call's allocations were counted as the ring path's";
  }
}

// Sessions opened one after another run on one stream of the daemon: a closed session's
// stream, drained, serves the next, and the calls on it are as correct as on a new one. Two
// sessions open at the same time have a stream each.
TEST_F(GpuCluster, SessionsOpenedInTurnShareOneStream) {
  Start(1);
  Alone alone;
  ASSERT_NO_FATAL_FAILURE(JoinAlone("turns", &alone));
  client::Client* client = alone.client.get();
  const client::Group& group = *alone.group;
  const int H = 4, D = 32, S = 8;
  const client::SessionSpec spec{H, D, DType::kFloat32, S, 2, {}, 0};
  const size_t n = static_cast<size_t>(S) * H * D;
  auto x = client->AllocBuffer(n * 4, "x");
  ASSERT_TRUE(x.ok()) << x.status();
  const uint64_t baseline = State(0).device_bytes();
  auto call_checked = [&](client::Session& session, int round) {
    // At W = 1 a scatter gives every head back in place: the result is the input.
    std::vector<float> xh(n), got(n);
    for (size_t i = 0; i < n; ++i) xh[i] = static_cast<float>(round * 100000 + i);
    ASSERT_TRUE(ipc::cuda::Copy(x->data, xh.data(), n * 4).ok());
    auto res = session.ScatterHeads(x->Ref(), 1, S);
    ASSERT_TRUE(res.ok()) << res.status();
    ASSERT_EQ(res->bytes, n * 4);
    ASSERT_TRUE(ipc::cuda::Copy(got.data(), res->data, n * 4).ok());
    EXPECT_EQ(std::memcmp(got.data(), xh.data(), n * 4), 0) << "round " << round;
    ASSERT_TRUE(res->Release().ok());
  };
  for (int round = 0; round < 3; ++round) {
    {
      auto session = client->CreateSession(group, spec);
      ASSERT_TRUE(session.ok()) << session.status();
      call_checked(**session, round);
    }
    // The session's slots are freed after its stream went back.
    ASSERT_TRUE(testing_util::Eventually([&] { return State(0).device_bytes() == baseline; }))
        << "round " << round << ": " << State(0).device_bytes() << " bytes held, baseline "
        << baseline;
  }
  EXPECT_EQ(State(0).device_streams(), 1u);
  auto a = client->CreateSession(group, spec);
  auto b = client->CreateSession(group, spec);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status() << " " << b.status();
  call_checked(**a, 3);
  call_checked(**b, 4);
  EXPECT_EQ(State(0).device_streams(), 2u);
}

// The start-up probe finds the daemon's hardware queues (a GPU has several), and sessions open
// at the same time each get a queue no other one uses: none is made past the queues.
TEST_F(GpuCluster, SessionsOpenAtOnceGetHardwareQueuesOfTheirOwn) {
  Start(1);
  Alone alone;
  ASSERT_NO_FATAL_FAILURE(JoinAlone("queues", &alone));
  const v1::DaemonState state = State(0);
  const int queues = state.hardware_queues();
  // What this device and MPS mode give a daemon, for the run's log (docs/benchmarks.md).
  RecordProperty("hardware_queues", queues);
  std::printf("daemon 0 found %d hardware queues for sessions (MPS mode %s)\n", queues,
              state.mps_mode().c_str());
  ASSERT_GE(queues, 2) << "the probe found too few queues to give two sessions one each";
  const client::SessionSpec spec{4, 32, DType::kFloat32, 8, 2, {}, 0};
  std::vector<std::unique_ptr<client::Session>> open;
  const int n = std::min(queues, 4);
  for (int i = 0; i < n; ++i) {
    auto s = alone.client->CreateSession(*alone.group, spec);
    ASSERT_TRUE(s.ok()) << s.status();
    open.push_back(std::move(*s));
  }
  EXPECT_EQ(State(0).hardware_queues_in_use(), n);
  EXPECT_EQ(State(0).queue_shared_streams(), 0u);
  for (auto& s : open) ASSERT_TRUE(s->Close().ok());
  EXPECT_TRUE(testing_util::Eventually([&] { return State(0).hardware_queues_in_use() == 0; }))
      << State(0).hardware_queues_in_use() << " queues still in use";
}

// With queues.sharing = refuse, the session past the probed queues is refused, naming the
// setting, and a queue given back serves the next session. A small probe keeps the queues few.
TEST_F(GpuCluster, PastTheHardwareQueuesRefuseNamesTheSetting) {
  Start(1, {"--queue-probe-streams", "2", "--queue-sharing", "refuse"});
  Alone alone;
  ASSERT_NO_FATAL_FAILURE(JoinAlone("refuse", &alone));
  const int queues = State(0).hardware_queues();
  ASSERT_GE(queues, 1);
  ASSERT_LE(queues, 3) << "2 streams and 1 at the greatest priority were probed";
  const client::SessionSpec spec{4, 32, DType::kFloat32, 8, 2, {}, 0};
  std::vector<std::unique_ptr<client::Session>> open;
  for (int i = 0; i < queues; ++i) {
    auto s = alone.client->CreateSession(*alone.group, spec);
    ASSERT_TRUE(s.ok()) << "session " << i << ": " << s.status();
    open.push_back(std::move(*s));
  }
  auto refused = alone.client->CreateSession(*alone.group, spec);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_NE(refused.status().message().find("queues.sharing"), std::string::npos)
      << refused.status();
  EXPECT_EQ(State(0).queue_refusals(), 1u);
  ASSERT_TRUE(open.back()->Close().ok());
  open.pop_back();
  absl::StatusOr<std::unique_ptr<client::Session>> again;
  EXPECT_TRUE(testing_util::Eventually([&] {
    again = alone.client->CreateSession(*alone.group, spec);
    return again.ok();
  })) << again.status();
  EXPECT_EQ(State(0).queue_shared_streams(), 0u);
}

// A peer daemon killed while a call waits on it: the survivor's call ends with an error within
// the configured call timeout, a session of another client on the survivor goes on, the
// survivor's device memory and mappings return to their baseline once the broken session is
// closed, and the survivor keeps serving new sessions.
TEST_F(GpuCluster, PeerDaemonKilledMidCallEndsTheCallAndTheSurvivorServes) {
  Start(2, {"--call-timeout-ms", "3000"});
  Bystander bystander;
  ASSERT_NO_FATAL_FAILURE(OpenBystander(Members(2)[0], "bystander", &bystander));
  ASSERT_EQ(bystander.Call(), "");
  const uint64_t bytes = State(0).device_bytes(), mappings = State(0).device_mappings_open();
  const client::SessionSpec spec{4, 64, DType::kBFloat16, 64, 2, {}, 0};
  TwoRanks t;
  ASSERT_NO_FATAL_FAILURE(OpenTwoRanks("kill", "survivor", "victim", spec, &t));
  const uint64_t before_x = State(0).device_bytes();
  auto x = t.c0->AllocBuffer(64 * 4 * 64 * 2, "x");
  ASSERT_TRUE(x.ok());
  const uint64_t x_bytes = State(0).device_bytes() - before_x;  // kept: the solo session uses it
  // Rank 1 never calls; its daemon dies while rank 0's call waits for it.
  std::thread killer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    daemons_[1].Kill();
  });
  const absl::Time t0 = absl::Now();
  auto res = t.s0->ScatterHeads(x->Ref(), 1, 64);
  const absl::Duration took = absl::Now() - t0;
  killer.join();
  ASSERT_FALSE(res.ok());
  EXPECT_TRUE(res.status().code() == absl::StatusCode::kDeadlineExceeded ||
              res.status().code() == absl::StatusCode::kAborted)
      << res.status();
  EXPECT_LT(took, absl::Seconds(20)) << "the call waited " << took;
  EXPECT_EQ(bystander.Call(), "") << "the bystander's session";
  EXPECT_GT(State(0).device_mappings_open(), mappings) << "the victim's slots, mapped";
  t.s0.reset();
  EXPECT_TRUE(testing_util::Eventually([&] {
    return State(0).device_mappings_open() == mappings && State(0).device_bytes() == bytes + x_bytes;
  })) << State(0).device_mappings_open() << " mappings open (baseline " << mappings << "), "
      << State(0).device_bytes() << " bytes held (baseline " << bytes << ", and " << x_bytes
      << " of the buffer)";
  // The survivor still serves: a one-rank session on it works.
  auto solo = t.c0->JoinGroup({"solo", 1, 0, {Members(2)[0]}, "nvlink", 0});
  ASSERT_TRUE(solo.ok()) << solo.status();
  auto s = t.c0->CreateSession(*solo, spec);
  ASSERT_TRUE(s.ok()) << s.status();
  auto ok = (*s)->ScatterHeads(x->Ref(), 1, 64);
  EXPECT_TRUE(ok.ok()) << ok.status();
}

// A call that times out reports where its stream stood: the protocol words of its slot as the
// device holds them (docs/protocol.md section 9.3), in the flight recorder's record of the call.
// Rank 1 never calls, so rank 0's stream granted its slot to rank 1 and waits for rank 1's grant.
TEST_F(GpuCluster, ATimedOutCallRecordsItsProtocolWords) {
  Start(2, {"--call-timeout-ms", "1500"});
  TwoRanks t;
  ASSERT_NO_FATAL_FAILURE(OpenTwoRanks("words", "caller", "absent",
                                       {4, 64, DType::kBFloat16, 64, 2, {}, 0}, &t));
  auto x = t.c0->AllocBuffer(64 * 4 * 64 * 2, "x");
  ASSERT_TRUE(x.ok());
  auto res = t.s0->ScatterHeads(x->Ref(), 1, 64);
  ASSERT_FALSE(res.ok());
  EXPECT_EQ(res.status().code(), absl::StatusCode::kDeadlineExceeded) << res.status();
  v1::ListRecentCallsResponse calls;
  grpc::ClientContext ctx;
  ASSERT_TRUE(Admin(0)->ListRecentCalls(&ctx, {}, &calls).ok());
  std::string message;
  for (const v1::CallRecord& c : calls.calls())
    if (c.session_id() == t.s0->id() && c.epoch() == 1) message = c.message();
  EXPECT_NE(message.find("protocol words: rank 0 slot 0 epoch 1: ready "), std::string::npos)
      << message;
  EXPECT_NE(message.find("done 0; from rank 1: grant 0, arrive 0; to rank 1: grant 1, arrive 0, "
                         "its done 0"),
            std::string::npos)
      << message;
  // The only session of its daemon: its stream has a hardware queue of its own.
  EXPECT_NE(message.find("; its stream on hardware queue "), std::string::npos) << message;
  EXPECT_NE(message.find(", its own"), std::string::npos) << message;
}

// A fused session's weights and inputs in a client's daemon buffers (zero-filled: every
// position 0), and its spec: `heads` heads of kFusedGpuHeadDim, calls of up to `tokens` rows.
struct FusedInputs {
  std::optional<client::Buffer> w, x, pos;
  client::FusedSessionSpec spec;
};

void MakeFusedInputs(client::Client& c, int32_t heads, int64_t tokens, FusedPath path,
                     FusedInputs* out) {
  const int32_t dim = kFusedGpuHeadDim, hidden = heads * dim, max_pos = 64;
  const size_t w_bytes = size_t{3} * hidden * hidden * 2;
  const size_t at_q = AlignUp(w_bytes, 256), at_k = at_q + 256, at_cs = at_k + 256;
  auto w = c.AllocBuffer(at_cs + size_t{max_pos} * dim * 4, "weights");
  auto x = c.AllocBuffer(static_cast<size_t>(tokens) * hidden * 2, "x");
  auto pos = c.AllocBuffer(static_cast<size_t>(tokens) * 4, "positions");
  ASSERT_TRUE(w.ok() && x.ok() && pos.ok());
  client::FusedSessionSpec& spec = out->spec;
  spec.hidden = hidden;
  spec.num_heads = heads;
  spec.head_dim = dim;
  spec.max_tokens = tokens;
  spec.max_pos = max_pos;
  spec.path = path;
  spec.weights.w_qkv = w->Tensor(DType::kBFloat16, {3 * hidden, hidden}, 0);
  spec.weights.q_norm = w->Tensor(DType::kBFloat16, {dim}, at_q);
  spec.weights.k_norm = w->Tensor(DType::kBFloat16, {dim}, at_k);
  spec.weights.cos_sin = w->Tensor(DType::kFloat32, {max_pos, dim}, at_cs);
  out->w = std::move(*w);
  out->x = std::move(*x);
  out->pos = std::move(*pos);
}

// Two ranks of a float32 session (H = 4, D = 32, S = 16, 2 slots) whose clients each hold an
// input x[s, h, d] = rank * 100000 + (s * H + h) * D + d in a device buffer (the inputs
// testing_util::CheckScatterOut knows): the stage of the tests of a call that waits on the GPU.
class GpuTwoRankScatter : public GpuCluster {
 protected:
  static constexpr int kH = 4, kD = 32, kS = 16, kHL = kH / 2;
  static constexpr size_t kElems = size_t{kS} * kH * kD;

  void Open(const std::string& group, const std::string& name0, const std::string& name1) {
    ASSERT_NO_FATAL_FAILURE(
        OpenTwoRanks(group, name0, name1, {kH, kD, DType::kFloat32, kS, 2, {}, 0}, &t_));
    client::Client* clients[2] = {t_.c0.get(), t_.c1.get()};
    for (int r = 0; r < 2; ++r) {
      auto b = clients[r]->AllocBuffer(kElems * 4, "x");
      ASSERT_TRUE(b.ok()) << b.status();
      std::vector<float> xh(kElems);
      for (size_t i = 0; i < kElems; ++i) xh[i] = static_cast<float>(r * 100000 + i);
      ASSERT_TRUE(ipc::cuda::Copy(b->data, xh.data(), kElems * 4).ok());
      x_[r] = *b;
    }
  }
  // scatter_heads of rank r's input, as CallArgs.
  CallArgs Scatter(int r) const {
    CallArgs args;
    args.op = OpKind::kScatterHeads;
    args.batch = 1;
    args.seq = kS;
    args.inputs[0] = x_[r].Ref();
    return args;
  }
  client::Session* session(int r) const { return r == 0 ? t_.s0.get() : t_.s1.get(); }
  // Reads a rank-0 result back and checks it ("" or the first wrong element).
  static std::string CheckRank0(const client::Result& result) {
    std::vector<float> got(result.bytes / 4);
    if (got.size() != kElems) return StrCat("the result holds ", got.size(), " elements");
    if (!ipc::cuda::Copy(got.data(), result.data, result.bytes).ok()) return "unreadable";
    return testing_util::CheckScatterOut(got, 0, kS, kH, kHL, kD, kHL * kD);
  }
  // Two daemons with a long call timeout, the two ranks' session (group `group`), and another
  // client of daemon 0 (`passer_by`) for the tests of what it may do beside a blocked call.
  // `queues`: the hardware queues daemon 0 must have for its sessions (the blocked one's and
  // the passer-by's streams); with fewer they share one, which the daemon reports
  // (queue_shared_streams) and these tests cannot tell from a defect, so they skip.
  void OpenWithPasserBy(const std::string& group, const std::string& passer_by, Alone* other,
                        int queues = 2, std::vector<std::string> flags = {}) {
    flags.insert(flags.begin(), {"--call-timeout-ms", "60000"});
    Start(2, std::move(flags));
    if (State(0).hardware_queues() < queues)
      GTEST_SKIP() << "daemon 0 found " << State(0).hardware_queues()
                   << " hardware queues for sessions; this case needs " << queues;
    ASSERT_NO_FATAL_FAILURE(Open(group, "early", "late"));
    ASSERT_NO_FATAL_FAILURE(JoinAlone(passer_by, other));
  }
  // Rank 0 submits a call (its epoch in *early) and its daemon's stream takes it: the slot is
  // being written, and the stream waits on the GPU for rank 1, which has not called.
  void BlockRank0(uint64_t* early) {
    auto submitted = session(0)->Submit(Scatter(0));
    ASSERT_TRUE(submitted.ok()) << submitted.status();
    *early = *submitted;
    ASSERT_TRUE(SlotReaches(0, session(0)->id(), 0, "writing"))
        << "rank 0's call never reached its daemon's stream";
  }
  // After work beside rank 0's waiting call (`in_time`: that work ended in time; otherwise
  // rank 0's call was let go already): rank 0's call still waits, then rank 1 makes it.
  // `what` names the work.
  void StillWaitingThenFinish(bool in_time, uint64_t early, const std::string& what) {
    if (!in_time) return;
    EXPECT_TRUE(SlotReaches(0, session(0)->id(), 0, "writing"))
        << "rank 0's call ended while " << what;
    FinishWithRank1(early);
  }
  // Rank 1 makes the call rank 0 submitted as `early`; rank 0's result must then be right.
  void FinishWithRank1(uint64_t early) {
    auto late = session(1)->Call(Scatter(1));
    ASSERT_TRUE(late.ok()) << late.status();
    auto result = session(0)->Wait(early, absl::Seconds(20));
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_TRUE(result->device);
    EXPECT_EQ(CheckRank0(*result), "");
  }

  // A fused call of `tokens` rows on `s`, from a thread, while rank 0's call (`early`) waits:
  // true when it returned within 20 s. When it did not, rank 0's call is let go (then the fused
  // call's) and the fused call's record and the plans are reported. Its views are released.
  bool FusedCallBesideTheWait(client::Session& s, const FusedInputs& in, int64_t tokens,
                              uint64_t early, const std::string& what, uint64_t epoch = 1) {
    absl::StatusOr<std::vector<client::Result>> views;
    std::atomic<bool> returned{false};
    std::thread call([&] {
      views = s.QkvNormRopeExchange(in.x->Ref(), in.pos->Ref(), 1, tokens);
      returned.store(true);
    });
    const bool in_time =
        testing_util::Eventually([&] { return returned.load(); }, absl::Seconds(20));
    EXPECT_TRUE(in_time) << what << " waited for another session's blocked call";
    if (!in_time) FinishWithRank1(early);
    call.join();
    if (!in_time) ADD_FAILURE() << CallTimes(s.id(), epoch) << Plans();
    EXPECT_TRUE(views.ok()) << views.status();
    if (views.ok()) {
      for (client::Result& v : *views) EXPECT_TRUE(v.Release().ok());
    }
    return in_time;
  }

  // Fused calls of each row count of `tokens` in turn (epochs 1, 2, ...), as
  // FusedCallBesideTheWait: true when every one returned in time; stops at the first that did
  // not (rank 0's call is then let go).
  bool FusedCallsBesideTheWait(client::Session& s, const FusedInputs& in,
                               std::initializer_list<int64_t> tokens, uint64_t early,
                               const std::string& what) {
    uint64_t epoch = 0;
    for (int64_t t : tokens) {
      if (!FusedCallBesideTheWait(s, in, t, early, StrCat(what, " of ", t, " rows"), ++epoch))
        return false;
    }
    return true;
  }

  // Where daemon 0's record of a session's call puts its time: from its start to the end of its
  // host work (enqueued on the stream), then to its end. A long first part is the daemon's
  // host held up in a CUDA call; a long second part, the call's work held up on the GPU.
  std::string CallTimes(uint64_t session_id, uint64_t epoch) {
    v1::ListRecentCallsResponse calls;
    grpc::ClientContext ctx;
    if (!Admin(0)->ListRecentCalls(&ctx, {}, &calls).ok()) return "no call records";
    for (const v1::CallRecord& c : calls.calls()) {
      if (c.session_id() != session_id || c.epoch() != epoch) continue;
      const auto ms = [&](int64_t at) { return (at - c.started_unix_us()) / 1000; };
      return StrCat("the call's record: ", c.status(), ", host work until +",
                    c.enqueued_unix_us() == 0 ? "(not stream-ordered)"
                                              : StrCat(ms(c.enqueued_unix_us()), " ms"),
                    c.done_unix_us() == 0 ? ", not done"
                                          : StrCat(", done at +", ms(c.done_unix_us()), " ms"),
                    "; ", c.message());
    }
    return "no record of the call";
  }
  // Daemon 0's plan of session `id` (empty when not listed).
  std::string PlanOf(uint64_t id) {
    v1::ListSessionsResponse resp;
    grpc::ClientContext ctx;
    if (!Admin(0)->ListSessions(&ctx, {}, &resp).ok()) return "";
    for (const v1::SessionState& st : resp.sessions())
      if (st.info().session_id() == id) return st.info().plan();
    return "";
  }
  // Daemon 0's sessions' plans (each names its streams' hardware queues).
  std::string Plans() {
    v1::ListSessionsResponse resp;
    grpc::ClientContext ctx;
    if (!Admin(0)->ListSessions(&ctx, {}, &resp).ok()) return "no sessions listed";
    std::string out;
    for (const v1::SessionState& st : resp.sessions())
      out += StrCat("\nsession ", st.info().session_id(), ": ", st.info().plan());
    return out;
  }

  TwoRanks t_;
  client::Buffer x_[2];
};

// PoisonSlots while a call waits on the GPU for its peer: the request returns without
// waiting for that call, leaves its slot alone (the result arrives intact once the peer
// calls) and fills only the free slot.
TEST_F(GpuTwoRankScatter, PoisonWhileACallWaitsForItsPeerSkipsItsSlotAndReturns) {
  Start(2);
  ASSERT_NO_FATAL_FAILURE(Open("poison-wait", "early", "late"));
  uint64_t early = 0;
  ASSERT_NO_FATAL_FAILURE(BlockRank0(&early));
  auto poisoned = session(0)->PoisonSlots();
  ASSERT_TRUE(poisoned.ok()) << poisoned.status();
  EXPECT_EQ(*poisoned, 1) << "only slot 1 is free";
  FinishWithRank1(early);
}

// A session that closes while another session of its daemon has a call waiting on the GPU
// for its peer: the close frees nothing that waits for the whole device (the daemon's pinned
// words are its device's, not the session's), so it returns while that call still waits,
// and the call completes once its peer calls.
TEST_F(GpuTwoRankScatter, ClosingASessionDoesNotWaitForAnotherSessionsBlockedCall) {
  // The other client's buffer is made first: what is tested is the session's making and
  // closing, not a buffer's (docs/architecture.md, section 8).
  Alone other;
  ASSERT_NO_FATAL_FAILURE(OpenWithPasserBy("blocked", "passer-by", &other));
  if (IsSkipped()) return;
  auto y = other.client->AllocBuffer(kElems * 4, "y");
  ASSERT_TRUE(y.ok()) << y.status();
  uint64_t early = 0;
  ASSERT_NO_FATAL_FAILURE(BlockRank0(&early));

  // The other client opens a session, calls once and closes it.
  {
    auto s = other.client->CreateSession(*other.group, {kH, kD, DType::kFloat32, kS, 2, {}, 0});
    ASSERT_TRUE(s.ok()) << s.status();
    auto res = (*s)->ScatterHeads(y->Ref(), 1, kS);
    ASSERT_TRUE(res.ok()) << res.status();
    ASSERT_TRUE(res->Release().ok());
    ASSERT_TRUE((*s)->Close().ok());
  }
  EXPECT_TRUE(SlotReaches(0, session(0)->id(), 0, "writing"))
      << "rank 0's call ended while the other session closed";
  FinishWithRank1(early);
}

// The same with a fused session passing by, on each of its paths (16 rows: one chunk on the
// chunked path, whose stores run on the plan's second stream): its plan's memory is freed in
// its own stream's order and its cuBLASLt handle goes back to the device's pool instead of
// being destroyed (cublasLtDestroy synchronizes the device), so neither its call nor its close
// waits for the blocked call. The session opens before rank 0's call blocks: it loads its
// GEMMs' kernels then, and the first launch of a cuBLASLt kernel waits for every stream of the
// device (docs/architecture.md, section 8; the case below, at a shape of its own, is the same
// with calls at several row counts). The call is given 20 s; one that waits for the blocked
// call fails the case, which then lets rank 0's call go and waits for it, so the next path
// still runs. Zero weights and inputs: the results do not matter here.
class GpuFusedPasserBy : public GpuTwoRankScatter,
                         public testing::WithParamInterface<FusedPath> {};

TEST_P(GpuFusedPasserBy, ClosingAFusedSessionDoesNotWaitForAnotherSessionsBlockedCall) {
  // The other client's buffers (daemon buffers, zero-filled) first, as above.
  Alone other;
  // The blocked session's stream, the fused session's and its plan's second stream.
  ASSERT_NO_FATAL_FAILURE(OpenWithPasserBy("blocked-fused", "fused-passer-by", &other, 3));
  if (IsSkipped()) return;
  constexpr int64_t kTokens = 16;
  FusedInputs in;
  ASSERT_NO_FATAL_FAILURE(MakeFusedInputs(*other.client, 2, kTokens, GetParam(), &in));
  {
    auto s = other.client->CreateFusedSession(*other.group, in.spec);
    if (GetParam() == FusedPath::kEpilogue &&
        s.status().code() == absl::StatusCode::kFailedPrecondition)
      GTEST_SKIP() << "no epilogue GEMM on this device: " << s.status();
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_EQ(State(0).queue_shared_streams(), 0u) << "a stream of the fused session shares a queue";
    uint64_t early = 0;
    ASSERT_NO_FATAL_FAILURE(BlockRank0(&early));
    const bool in_time = FusedCallBesideTheWait(
        **s, in, kTokens, early, StrCat("the fused call (path ", FusedPathName(GetParam()), ")"));
    ASSERT_TRUE((*s)->Close().ok());
    StillWaitingThenFinish(in_time, early, "the fused session closed");
  }
}

// A fused session (path auto, as sessions open by default) opened before another session's
// call blocks, at a shape no other case of this daemon uses: it loaded its GEMMs' kernels when
// it opened (the first launch of a cuBLASLt kernel waits for every stream of the device), so
// its calls, at max_tokens rows and at row counts it never ran, complete while the other call
// waits; its plan says that every one ran a loaded kernel. (Asked for, the chunked path's
// calls of two chunks waited here under MPS: docs/architecture.md, section 6.2.)
TEST_F(GpuTwoRankScatter, AFusedSessionOpenedBeforeAnotherCallBlocksCallsBesideIt) {
  Alone other;
  // The blocked session's stream and the fused session's (path auto takes no second stream).
  ASSERT_NO_FATAL_FAILURE(OpenWithPasserBy("blocked-loaded", "loaded-fused", &other, 2));
  if (IsSkipped()) return;
  constexpr int32_t kHeads = 6;
  constexpr int64_t kTokens = 1000;
  FusedInputs in;
  ASSERT_NO_FATAL_FAILURE(
      MakeFusedInputs(*other.client, kHeads, kTokens, FusedPath::kAuto, &in));
  auto s = other.client->CreateFusedSession(*other.group, in.spec);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(State(0).queue_shared_streams(), 0u) << "a stream of the fused session shares a queue";
  uint64_t early = 0;
  ASSERT_NO_FATAL_FAILURE(BlockRank0(&early));
  const bool in_time = FusedCallsBesideTheWait(**s, in, {kTokens, 333, 777, 1}, early,
                                               "the loaded session's call");
  const std::string plan = PlanOf((*s)->id());
  // The rule's path for each: epilogue from 512 rows where the device has the epilogue GEMM.
  const bool epilogue = plan.find("(rule: epilogue from 512 rows") != std::string::npos;
  for (int64_t rows : {kTokens, int64_t{333}, int64_t{777}, int64_t{1}}) {
    const char* path = epilogue && rows >= 512 ? "epilogue" : "per_operator";
    EXPECT_NE(plan.find(StrCat("rows ", rows, ": ", path, " (auto: ")), std::string::npos) << plan;
  }
  // A session that cannot take the chunked path takes no second hardware queue.
  EXPECT_NE(plan.find("no second stream (path not chunked)"), std::string::npos) << plan;
  EXPECT_NE(plan.find("cuBLASLt kernels first launched by calls since: 0;"), std::string::npos)
      << plan;
  EXPECT_EQ(plan.find("cuBLASLt kernels loaded at open: 0;"), std::string::npos) << plan;
  ASSERT_TRUE((*s)->Close().ok());
  StillWaitingThenFinish(in_time, early, "the fused session called");
}

// With fused.projection cutlass a fused session launches no cuBLASLt kernel, so one opened
// while another session's call waits on the GPU for its peer is not held by a first launch: at
// a shape no other case uses, it opens, calls at several row counts and closes while the other
// call waits. Skips where the daemon has no epilogue GEMM (its plan then says cublaslt).
TEST_F(GpuTwoRankScatter, WithTheCutlassProjectionAFusedSessionOpensAndCallsBesideABlockedCall) {
  Alone other;
  ASSERT_NO_FATAL_FAILURE(OpenWithPasserBy("blocked-cutlass", "cutlass-fused", &other, 3,
                                           {"--fused-projection", "cutlass"}));
  if (IsSkipped()) return;
  constexpr int32_t kHeads = 10;
  constexpr int64_t kTokens = 700;
  FusedInputs in;
  ASSERT_NO_FATAL_FAILURE(MakeFusedInputs(*other.client, kHeads, kTokens, FusedPath::kAuto, &in));
  uint64_t early = 0;
  ASSERT_NO_FATAL_FAILURE(BlockRank0(&early));
  absl::StatusOr<std::unique_ptr<client::Session>> s;
  std::atomic<bool> opened{false};
  std::thread open([&] {
    s = other.client->CreateFusedSession(*other.group, in.spec);
    opened.store(true);
  });
  const bool open_in_time =
      testing_util::Eventually([&] { return opened.load(); }, absl::Seconds(20));
  if (!open_in_time) FinishWithRank1(early);
  open.join();
  ASSERT_TRUE(open_in_time) << "the fused session's open waited for the blocked call" << Plans();
  ASSERT_TRUE(s.ok()) << s.status();
  const std::string plan = PlanOf((*s)->id());
  if (plan.find("projection GEMM: cublaslt (") != std::string::npos) {
    ASSERT_TRUE((*s)->Close().ok());
    FinishWithRank1(early);
    GTEST_SKIP() << "no epilogue GEMM on this device: " << plan;
  }
  EXPECT_NE(plan.find("projection GEMM: cutlass;"), std::string::npos) << plan;
  const bool in_time = FusedCallsBesideTheWait(**s, in, {kTokens, 333, 1}, early,
                                               "the cutlass session's call");
  // No cuBLASLt kernel loaded, and none run by the calls.
  const std::string after = PlanOf((*s)->id());
  EXPECT_NE(after.find("cuBLASLt kernels loaded at open: 0;"), std::string::npos) << after;
  EXPECT_NE(after.find("cuBLASLt GEMMs run by calls: 0\n"), std::string::npos) << after;
  ASSERT_TRUE((*s)->Close().ok());
  StillWaitingThenFinish(in_time, early, "the cutlass session ran");
}

INSTANTIATE_TEST_SUITE_P(Paths, GpuFusedPasserBy,
                         testing::Values(FusedPath::kPerOperator, FusedPath::kEpilogue,
                                         FusedPath::kChunked, FusedPath::kAuto),
                         [](const testing::TestParamInfo<FusedPath>& info) {
                           return std::string(FusedPathName(info.param));
                         });

// A hostile client maps its own slot allocation writable (the access flags of a mapping are
// the importer's choice) and writes an epoch past every call over all of it. Nothing a daemon
// relies on lives there: its next call, for the slot its peer still holds, waits for the
// peer's grant as ever and fails, and the peer's held result is untouched.
TEST_F(GpuTwoRankScatter, AClientWritingOverItsSlotAllocationCannotReachAPeersHeldResult) {
  ASSERT_TRUE(VmmDriver::Get().ok()) << "the driver lacks the VMM entry points";
  const VmmDriver& drv = VmmDriver::Get();
  Start(2, {"--call-timeout-ms", "1500"});
  ASSERT_NO_FATAL_FAILURE(Open("forge", "victim", "forger"));
  // Epochs 1 and 2 on both ranks: the victim keeps epoch 1's result (slot 0).
  absl::StatusOr<client::Result> results[2][2];
  for (int e = 0; e < 2; ++e) {
    std::thread other([&] { results[1][e] = session(1)->Call(Scatter(1)); });
    results[0][e] = session(0)->Call(Scatter(0));
    other.join();
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(results[r][e].ok()) << results[r][e].status();
  }
  const client::Result& held = *results[0][0];
  ASSERT_TRUE(held.device && held.held());
  ASSERT_EQ(CheckRank0(held), "");
  std::vector<float> before(held.bytes / 4), after(held.bytes / 4);
  ASSERT_TRUE(ipc::cuda::Copy(before.data(), held.data, held.bytes).ok());
  ASSERT_TRUE(results[0][1]->Release().ok());
  ASSERT_TRUE(results[1][1]->Release().ok());

  // The forger maps its slot allocation again, writable, and fills it with kUnblockEpoch,
  // all but its first 128 bytes (where the cancel word stood when the daemons' words led
  // this allocation: a forged cancel would stop the stores this test looks for).
  const CUdeviceptr view = reinterpret_cast<CUdeviceptr>(results[1][0]->data);
  CUdeviceptr base = 0;
  size_t size = 0;
  ASSERT_EQ(drv.AddressRange(&base, &size, view), CUDA_SUCCESS);
  CUmemGenericAllocationHandle handle = 0;
  ASSERT_EQ(drv.RetainHandle(&handle, reinterpret_cast<void*>(base)), CUDA_SUCCESS);
  CUdeviceptr writable = 0;
  ASSERT_EQ(drv.AddressReserve(&writable, size, 0, 0, 0), CUDA_SUCCESS);
  ASSERT_EQ(drv.Map(writable, size, 0, handle, 0), CUDA_SUCCESS);
  int device = 0;
  ASSERT_EQ(cudaGetDevice(&device), cudaSuccess);
  CUmemAccessDesc access{};
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  ASSERT_EQ(drv.SetAccess(writable, size, &access, 1), CUDA_SUCCESS);
  constexpr size_t kKept = 128;
  const std::vector<uint64_t> forged((size - kKept) / sizeof(uint64_t), kUnblockEpoch);
  ASSERT_TRUE(ipc::cuda::Copy(reinterpret_cast<void*>(writable + kKept), forged.data(),
                              size - kKept)
                  .ok());
  // A copy from pageable memory may return before its DMA has landed: wait for it before the
  // mapping goes (else the forged words might never arrive, or the copy fault on the unmapped
  // range). No stream of this process waits for a call now.
  ASSERT_EQ(cudaStreamSynchronize(cudaStreamLegacy), cudaSuccess);
  drv.Unmap(writable, size);
  drv.AddressFree(writable, size);
  drv.MemRelease(handle);
  ASSERT_TRUE(results[1][0]->Release().ok());

  // Epoch 3 needs slot 0, which the victim holds: the forger's call waits for the victim's
  // grant and fails at the call timeout.
  auto third = session(1)->Submit(Scatter(1));
  if (third.ok()) {
    auto got = session(1)->Wait(*third, absl::Seconds(20));
    EXPECT_FALSE(got.ok()) << "the forger's call completed without the victim's grant";
  }
  ASSERT_TRUE(held.held());
  ASSERT_TRUE(ipc::cuda::Copy(after.data(), held.data, held.bytes).ok());
  EXPECT_EQ(std::memcmp(before.data(), after.data(), held.bytes), 0)
      << "the victim's held result changed";
}

// The slot budget holds what each session holds, as allocated (allocations round up to the
// device's granularity), and gets exactly that back when the session closes: closing one of
// two sessions leaves the other's share, closing both leaves nothing.
TEST_F(GpuCluster, TheSlotBudgetGetsBackExactlyWhatEachSessionHeld) {
  Start(1);
  auto c = client::Client::Connect({Members(1)[0], "budget"});
  ASSERT_TRUE(c.ok()) << c.status();
  auto g = (*c)->JoinGroup({"budget", 1, 0, Members(1), "nvlink", 0});
  ASSERT_TRUE(g.ok()) << g.status();
  const uint64_t base = State(0).slot_budget_used_bytes();
  const uint64_t device0 = State(0).device_bytes();
  EXPECT_EQ(base, 0u);
  // Sizes that are not multiples of the 2 MiB granularity.
  auto a = (*c)->CreateSession(*g, {8, 64, DType::kBFloat16, 1000, 2, {}, 0});
  ASSERT_TRUE(a.ok()) << a.status();
  const uint64_t with_a = State(0).slot_budget_used_bytes();
  // What the budget holds covers the device memory the session allocated.
  EXPECT_GE(with_a - base, State(0).device_bytes() - device0);
  auto b = (*c)->CreateSession(*g, {8, 128, DType::kFloat32, 3000, 3, {}, 0});
  ASSERT_TRUE(b.ok()) << b.status();
  const uint64_t with_both = State(0).slot_budget_used_bytes();
  ASSERT_GT(with_both, with_a);
  // A session gives its share back once it is destroyed (after its stream drained), which may
  // be just after its close returns.
  ASSERT_TRUE((*a)->Close().ok());
  EXPECT_TRUE(testing_util::Eventually(
      [&] { return State(0).slot_budget_used_bytes() == with_both - with_a; }))
      << "closing the first session gave back another amount than it held: "
      << State(0).slot_budget_used_bytes() << " left";
  ASSERT_TRUE((*b)->Close().ok());
  EXPECT_TRUE(
      testing_util::Eventually([&] { return State(0).slot_budget_used_bytes() == base; }))
      << State(0).slot_budget_used_bytes();
  EXPECT_EQ(State(0).slot_budget_bytes(), uint64_t{8} << 30);
}

// A client killed mid-call, in a process of its own: rank 1's client dies while rank 0's call
// waits for it (phase "session": rank 1 never called; phase "gated": rank 1's call is on its
// daemon's stream, waiting for inputs its held stream never gives). Rank 0's call ends with
// ABORTED long before the call timeout, rank 1's daemon gives back every byte of device memory
// the client and its session held (its own count, and the GPU's free memory once rank 0's
// broken session is closed too), a session of another client open on rank 1's daemon all along
// goes on, and both daemons serve new sessions.
class GpuClientKill : public GpuCluster, public testing::WithParamInterface<const char*> {};


// The phase client: $GPU_PHASE_CLIENT when set (a build copied to another machine), else this
// build's.
std::string PhaseClientPath() {
  const char* e = std::getenv("GPU_PHASE_CLIENT");
  return e != nullptr && *e != '\0' ? e : GPU_PHASE_CLIENT_PATH;
}

TEST_P(GpuClientKill, ThePeersCallIsAbortedAndTheDaemonReturnsToBaseline) {
  const std::string phase = GetParam();
  // Without it rank 1 would only show as a rendezvous that timed out.
  const std::string program = PhaseClientPath();
  const int not_runnable = ::access(program.c_str(), X_OK) == 0 ? 0 : errno;
  ASSERT_EQ(not_runnable, 0) << "the phase client " << program << " cannot be run here: "
                             << std::strerror(not_runnable)
                             << "; GPU_PHASE_CLIENT names it where the build was copied";
  // A call timeout far beyond the test's: ABORTED can only come from the kill.
  Start(2, {"--call-timeout-ms", "600000"});
  const uint64_t baseline0 = State(0).device_bytes();
  // A bystander: another client's one-rank session on rank 1's daemon, used before and after.
  Bystander bystander;
  ASSERT_NO_FATAL_FAILURE(OpenBystander(Members(2)[1], "bystander", &bystander));
  ASSERT_EQ(bystander.Call(), "");
  const uint64_t baseline = State(1).device_bytes();
  // The GPU's free memory with the bystander's session in place, before the killed client
  // and its peer's session exist. Their sessions' slots (2 x 3 x 64K x 8 x 64 x 2 bytes, about
  // 400 MB per rank) dwarf what a CUDA context or stream may take lazily.
  const int victim_device = State(1).device();
  const size_t free_before = DeviceFreeBytes(victim_device);
  const std::string ready = dir_ + "/gpu-phase.ready";
  const std::string members = Members(2)[0] + "," + Members(2)[1];
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execl(program.c_str(), program.c_str(), "--members", members.c_str(), "--rank",
            "1", "--phase", phase.c_str(), "--ready", ready.c_str(), static_cast<char*>(nullptr));
    _exit(127);
  }
  ASSERT_GT(pid, 0);
  struct Reap {
    pid_t pid;
    ~Reap() {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  } reap{pid};
  auto c0 = client::Client::Connect({Members(2)[0], "survivor"});
  ASSERT_TRUE(c0.ok()) << c0.status();
  auto g0 = (*c0)->JoinGroup({"gpu-phase", 2, 0, Members(2), "nvlink", 0});
  ASSERT_TRUE(g0.ok()) << g0.status();
  auto s0 = (*c0)->CreateSession(*g0, {8, 64, DType::kBFloat16, testing_util::kGpuPhaseMaxTokens,
                                        2, {}, 0});
  ASSERT_TRUE(s0.ok()) << s0.status();
  auto x = (*c0)->AllocBuffer(64 * 8 * 64 * 2, "x");
  ASSERT_TRUE(x.ok()) << x.status();
  ASSERT_TRUE(testing_util::Eventually([&] { return ::access(ready.c_str(), F_OK) == 0; }))
      << "the phase client did not get to its phase";
  if (phase == "gated") {
    ASSERT_TRUE(testing_util::Eventually([&] { return State(1).active_calls() == 1; }))
        << "rank 1's call is not in its daemon";
  }
  absl::StatusOr<client::Result> call;
  std::thread caller([&] { call = (*s0)->ScatterHeads(x->Ref(), 1, 64); });
  EXPECT_TRUE(testing_util::Eventually([&] { return State(0).active_calls() == 1; }))
      << "rank 0's call is not in its daemon";
  ::kill(pid, SIGKILL);
  caller.join();
  ASSERT_FALSE(call.ok());
  EXPECT_EQ(call.status().code(), absl::StatusCode::kAborted) << call.status();
  // Rank 1's daemon reclaimed the client: only the bystander and its session are left, and its
  // memory is back to baseline.
  EXPECT_TRUE(testing_util::Eventually([&] {
    const std::vector<v1::ClientState> clients = ListClients(1);
    return clients.size() == 1 && clients[0].name() == "bystander";
  })) << ListClients(1).size() << " clients on rank 1's daemon";
  EXPECT_TRUE(testing_util::Eventually([&] { return NumSessions(1) == 1; }))
      << NumSessions(1) << " sessions on rank 1's daemon";
  EXPECT_TRUE(testing_util::Eventually([&] { return State(1).device_bytes() == baseline; }))
      << State(1).device_bytes() << " bytes held, baseline " << baseline;
  // The bystander's session went on through all of it.
  EXPECT_EQ(bystander.Call(), "") << "the bystander's session";
  // Rank 0's broken session closed, and its client gone: both daemons are back to their
  // counts, and the GPU to its free memory (rank 0's mapping of rank 1's slots is gone too).
  s0->reset();
  c0->reset();
  EXPECT_TRUE(testing_util::Eventually([&] { return State(0).device_bytes() == baseline0; }))
      << State(0).device_bytes() << " bytes held by rank 0, baseline " << baseline0;
  constexpr size_t kSlack = size_t{64} << 20;
  EXPECT_TRUE(testing_util::Eventually(
      [&] { return DeviceFreeBytes(victim_device) + kSlack >= free_before; }))
      << "free device memory " << DeviceFreeBytes(victim_device) << ", before " << free_before;
  // Both daemons serve: a one-rank session on each runs a call, bit-exact on the device.
  for (int r = 0; r < 2; ++r) {
    Bystander after;
    ASSERT_NO_FATAL_FAILURE(OpenBystander(Members(2)[r], StrCat("after-", r), &after));
    EXPECT_EQ(after.Call(), "") << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Phases, GpuClientKill, testing::Values("session", "gated"),
                         [](const testing::TestParamInfo<const char*>& i) {
                           return std::string(i.param);
                         });

}  // namespace
}  // namespace ulysses
