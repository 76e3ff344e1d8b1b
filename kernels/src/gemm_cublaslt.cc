// Bf16Gemm on cuBLASLt. cuBLASLt is column-major: the row-major product out[m, n] =
// x[m, k] @ w[n, k]^T is computed as the column-major out^T[n, m] = (w^T)^T[n, k] @ x^T[k, m],
// i.e. A = w (column-major [k, n], ld k, transposed), B = x (column-major [k, m], ld k), and
// C = D = out (column-major [n, m], ld n): the "TN" bf16 GEMM.
#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda_check.h"
#include "device_memory.h"
#include "gemm_check.h"
#include "ulysses/common/status.h"
#include "ulysses/kernels/gemm.h"

namespace ulysses::kernels {
namespace {

// cublasLtDestroy, like cublasDestroy, synchronizes the whole device: a plan that destroyed its
// handle on close would wait for every stream of the device, including another session's call
// that waits for its peer. So handles are made once per device and never destroyed: a plan
// takes one from its device's pool (or makes one) and gives it back when it goes. A handle
// serves one plan at a time, so no handle is shared between threads.
class LeasedHandle {
 public:
  LeasedHandle() = default;
  ~LeasedHandle() { GiveBack(); }
  LeasedHandle(LeasedHandle&& o) noexcept
      : device_(o.device_), handle_(std::exchange(o.handle_, nullptr)) {}
  LeasedHandle& operator=(LeasedHandle&& o) noexcept {
    if (this != &o) {
      GiveBack();
      device_ = o.device_;
      handle_ = std::exchange(o.handle_, nullptr);
    }
    return *this;
  }
  LeasedHandle(const LeasedHandle&) = delete;
  LeasedHandle& operator=(const LeasedHandle&) = delete;

  // A handle of the current device.
  static absl::StatusOr<LeasedHandle> Take() {
    LeasedHandle lease;
    ULY_CUDA_RETURN_IF_ERROR(cudaGetDevice(&lease.device_));
    {
      std::lock_guard<std::mutex> lock(Pool().mu);
      std::vector<cublasLtHandle_t>& idle = Pool().idle[lease.device_];
      if (!idle.empty()) {
        lease.handle_ = idle.back();
        idle.pop_back();
        return lease;
      }
    }
    ULY_CUBLAS_RETURN_IF_ERROR(cublasLtCreate(&lease.handle_));
    return lease;
  }
  cublasLtHandle_t get() const { return handle_; }
  int device() const { return device_; }

 private:
  struct Handles {
    std::mutex mu;
    std::map<int, std::vector<cublasLtHandle_t>> idle;  // by device
  };
  // Never destroyed: the handles outlive every plan, static destructors included.
  static Handles& Pool() {
    static Handles* pool = new Handles;
    return *pool;
  }
  void GiveBack() {
    if (handle_ == nullptr) return;
    std::lock_guard<std::mutex> lock(Pool().mu);
    Pool().idle[device_].push_back(std::exchange(handle_, nullptr));
  }

  int device_ = -1;
  cublasLtHandle_t handle_ = nullptr;
};

// Alignment classes an algorithm is chosen for: the largest of these dividing every pointer.
constexpr uint32_t kAlignments[] = {256, 128, 64, 32, 16};

uint32_t AlignmentOf(const void* x, const void* w, const void* out) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w) |
                         reinterpret_cast<uintptr_t>(out);
  for (uint32_t a : kAlignments) {
    if (bits % a == 0) return a;
  }
  return 0;
}

// cuBLASLt's pick per GEMM shape, shared by the process's GEMMs. A daemon opens a fused
// session per attention layer, the layers of a model all of one shape, and each session's
// load asks for every row count up to 2048 (about 0.1-0.2 ms a query): the answer depends on
// the device, the shape, the alignment class and the workspace alone, so it is asked once.
class PickCache {
 public:
  using Key = std::tuple<int, int64_t, int64_t, int64_t, uint32_t, size_t>;  // device n k m a ws

  static PickCache& Get() {
    static PickCache* cache = new PickCache;  // never destroyed: GEMMs may outlive statics
    return *cache;
  }
  bool Find(const Key& key, cublasLtMatmulAlgo_t& algo) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = picks_.find(key);
    if (it == picks_.end()) return false;
    algo = it->second;
    return true;
  }
  void Insert(const Key& key, const cublasLtMatmulAlgo_t& algo) {
    std::lock_guard<std::mutex> lock(mu_);
    if (picks_.size() >= kMaxPicks) picks_.clear();  // bounded; asked again if they come back
    picks_.emplace(key, algo);
  }
  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    picks_.clear();
  }
  void CountQuery() { queries_.fetch_add(1, std::memory_order_relaxed); }
  size_t queries() const { return queries_.load(std::memory_order_relaxed); }

 private:
  static constexpr size_t kMaxPicks = size_t{1} << 16;
  std::mutex mu_;
  std::map<Key, cublasLtMatmulAlgo_t> picks_;
  std::atomic<size_t> queries_{0};
};

}  // namespace

struct Bf16Gemm::Impl {
  // Descriptors and algorithm of one (m, alignment).
  struct Shape {
    internal::LtLayout x;    // B: [k, m] column-major
    internal::LtLayout out;  // C and D: [n, m] column-major
    cublasLtMatmulAlgo_t algo{};  // cuBLASLt's choice
    // What Run launches once the GEMM is loaded (`algo` or a loaded one), as of load
    // `generation` (0: not chosen yet).
    cublasLtMatmulAlgo_t run{};
    uint64_t generation = 0;
  };
  int64_t n = 0, k = 0;
  LeasedHandle handle;
  internal::LtMatmulDesc desc;
  internal::LtLayout w;  // A: [k, n] column-major, transposed by the op
  internal::DeviceMemory workspace;
  size_t workspace_bytes = 0;
  // Room for a load's every-row counts (up to kMaxEveryRowLoad) and its other counts at every
  // class, with calls' row counts beside them.
  static constexpr size_t kMaxShapes = 8192;
  std::map<std::pair<int64_t, uint32_t>, Shape> shapes;  // at most kMaxShapes
  // The algorithms Load asked for, by the alignment class and row count they were chosen for.
  std::map<std::pair<uint32_t, int64_t>, cublasLtMatmulAlgo_t> loaded;
  // Distinct algorithms launched since the first Load, each with the alignment class of the
  // pointers it ran on (cuBLASLt may pick a kernel of the algorithm by the pointers' actual
  // alignment): by Load, then any a call ran that Load had not (each counted in `unloaded`).
  std::vector<std::pair<cublasLtMatmulAlgo_t, uint32_t>> launched;
  uint64_t generation = 0;  // Loads so far
  // Read from other threads (describe()) while a call runs.
  std::atomic<size_t> loaded_count{0}, unloaded{0}, runs{0};

  absl::StatusOr<Shape*> Get(int64_t m, uint32_t alignment) {
    auto it = shapes.find({m, alignment});
    if (it != shapes.end()) return &it->second;
    // Bounded (a caller may run every row count up to a large maximum): a shape let go is made
    // again, host work only, if it comes back; what the GEMM loaded is kept apart (`loaded`).
    if (shapes.size() >= kMaxShapes) shapes.erase(shapes.begin());
    Shape s;
    ULY_ASSIGN_OR_RETURN(s.x, internal::LtLayout::Create(k, m, k));
    ULY_ASSIGN_OR_RETURN(s.out, internal::LtLayout::Create(n, m, n));
    const PickCache::Key key{handle.device(), n, k, m, alignment, workspace_bytes};
    if (PickCache::Get().Find(key, s.algo))
      return &shapes.emplace(std::make_pair(m, alignment), std::move(s)).first->second;
    internal::LtPreference pref;
    ULY_RETURN_IF_ERROR(pref.Init());
    const uint64_t ws = workspace_bytes;
    ULY_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceSetAttribute(
        pref.get(), CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    for (auto attr :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES}) {
      ULY_CUBLAS_RETURN_IF_ERROR(
          cublasLtMatmulPreferenceSetAttribute(pref.get(), attr, &alignment, sizeof alignment));
    }
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    PickCache::Get().CountQuery();
    ULY_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulAlgoGetHeuristic(handle.get(), desc.get(), w.get(),
                                                              s.x.get(), s.out.get(), s.out.get(),
                                                              pref.get(), 1, &result, &found));
    // NotFound, apart from the errors above: Load skips a lower alignment class for it alone.
    if (found == 0 || result.state != CUBLAS_STATUS_SUCCESS)
      return absl::NotFoundError(absl::StrCat("cuBLASLt has no bf16 algorithm for m=", m, " n=", n,
                                              " k=", k, " alignment ", alignment));
    s.algo = result.algo;
    PickCache::Get().Insert(key, s.algo);
    return &shapes.emplace(std::make_pair(m, alignment), std::move(s)).first->second;
  }

  // Get for a call: no algorithm is an internal error there (NotFound only tells Load to skip
  // a class).
  absl::StatusOr<Shape*> ForCall(int64_t m, uint32_t alignment) {
    absl::StatusOr<Shape*> s = Get(m, alignment);
    if (!s.ok() && absl::IsNotFound(s.status())) return absl::InternalError(s.status().message());
    return s;
  }

  static bool Same(const cublasLtMatmulAlgo_t& a, const cublasLtMatmulAlgo_t& b) {
    return std::memcmp(&a, &b, sizeof a) == 0;
  }
  bool Launched(const cublasLtMatmulAlgo_t& algo, uint32_t alignment) const {
    return std::any_of(launched.begin(), launched.end(), [&](const auto& l) {
      return l.second == alignment && Same(l.first, algo);
    });
  }
  // Whether cuBLASLt runs `algo` for shape `s` within the workspace.
  bool Accepts(const Shape& s, const cublasLtMatmulAlgo_t& algo) const {
    cublasLtMatmulHeuristicResult_t result{};
    return cublasLtMatmulAlgoCheck(handle.get(), desc.get(), w.get(), s.x.get(), s.out.get(),
                                   s.out.get(), &algo, &result) == CUBLAS_STATUS_SUCCESS &&
           result.workspaceSize <= workspace_bytes;
  }

  // The algorithm a Run of `s` (m rows, `alignment`) launches: cuBLASLt's choice until the
  // GEMM is loaded; then that choice if it was launched, else the first loaded algorithm of
  // the same alignment, in PinnedTryOrder of the row counts they were chosen for, that
  // cuBLASLt accepts for m; cuBLASLt's choice when none is.
  const cublasLtMatmulAlgo_t& Choose(Shape& s, int64_t m, uint32_t alignment) {
    if (generation == 0) return s.algo;
    if (s.generation == generation) return s.run;
    s.generation = generation;
    s.run = s.algo;
    if (Launched(s.algo, alignment)) return s.run;
    std::vector<const cublasLtMatmulAlgo_t*> candidates;
    std::vector<int64_t> rows;
    for (auto it = loaded.lower_bound({alignment, 0});
         it != loaded.end() && it->first.first == alignment; ++it) {
      candidates.push_back(&it->second);
      rows.push_back(it->first.second);
    }
    std::vector<const cublasLtMatmulAlgo_t*> checked;  // each distinct algorithm asked once
    for (size_t i : PinnedTryOrder(rows, m)) {
      const cublasLtMatmulAlgo_t& algo = *candidates[i];
      if (std::any_of(checked.begin(), checked.end(),
                      [&](const cublasLtMatmulAlgo_t* c) { return Same(*c, algo); }))
        continue;
      checked.push_back(&algo);
      if (Accepts(s, algo)) {
        s.run = algo;
        return s.run;
      }
    }
    return s.run;
  }

  // Counts a call's launch of an algorithm no earlier launch since the first Load ran at the
  // call's alignment class.
  void CountLaunch(const cublasLtMatmulAlgo_t& algo, uint32_t alignment) {
    if (generation == 0 || Launched(algo, alignment)) return;
    launched.emplace_back(algo, alignment);
    unloaded.fetch_add(1, std::memory_order_relaxed);
  }

  absl::Status Launch(const cublasLtMatmulAlgo_t& algo, const Shape& s, const void* x,
                      const void* w_ptr, void* out, cudaStream_t stream) {
    const float alpha = 1.0f, beta = 0.0f;
    ULY_CUBLAS_RETURN_IF_ERROR(cublasLtMatmul(handle.get(), desc.get(), &alpha, w_ptr, w.get(), x,
                                              s.x.get(), &beta, out, s.out.get(), out,
                                              s.out.get(), &algo, workspace.get(),
                                              workspace_bytes, stream));
    return absl::OkStatus();
  }
};

absl::Status Bf16Gemm::WarmUp(cudaStream_t stream) {
  // Once per device: a second backend of the daemon runs no more work on another stream.
  static std::mutex* mu = new std::mutex;
  static std::set<int>* warmed = new std::set<int>;
  int device = 0;
  ULY_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  std::lock_guard<std::mutex> lock(*mu);
  if (warmed->count(device) != 0) return absl::OkStatus();
  cudaStream_t own = nullptr;
  if (stream == nullptr) {
    ULY_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
    stream = own;
  }
  // Small shapes: what is warmed is meant to be cuBLASLt's, not a shape's (the kernel-level
  // case's query at a row count new to the process tests that). The GEMM's handle goes back
  // into the pool, and its memory is freed on `stream`, as they go (before the wait below).
  constexpr int64_t kN = 384, kK = 128, kRows[] = {16, 2048};
  const absl::Status status = [&]() -> absl::Status {
    ULY_ASSIGN_OR_RETURN(std::unique_ptr<Bf16Gemm> gemm,
                         Create(kN, kK, kDefaultWorkspaceBytes, stream));
    const int64_t rows = kRows[1];
    internal::DeviceMemory x, w, out;
    ULY_RETURN_IF_ERROR(x.Allocate(static_cast<size_t>(rows * kK) * sizeof(uint16_t), stream));
    ULY_RETURN_IF_ERROR(w.Allocate(static_cast<size_t>(kN * kK) * sizeof(uint16_t), stream));
    ULY_RETURN_IF_ERROR(out.Allocate(static_cast<size_t>(rows * kN) * sizeof(uint16_t), stream));
    ULY_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(x.get(), 0, x.bytes(), stream));
    ULY_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(w.get(), 0, w.bytes(), stream));
    for (int64_t m : kRows) {
      ULY_RETURN_IF_ERROR(gemm->Prepare(m));
      ULY_RETURN_IF_ERROR(gemm->Run(x.get(), w.get(), out.get(), m, stream));
    }
    return absl::OkStatus();
  }();
  const cudaError_t synced = cudaStreamSynchronize(stream);
  if (own != nullptr) cudaStreamDestroy(own);
  ULY_RETURN_IF_ERROR(status);
  if (synced != cudaSuccess)
    return internal::CudaError("cudaStreamSynchronize", synced, __FILE__, __LINE__);
  warmed->insert(device);
  return absl::OkStatus();
}

Bf16Gemm::Bf16Gemm(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Bf16Gemm::~Bf16Gemm() = default;

absl::StatusOr<std::unique_ptr<Bf16Gemm>> Bf16Gemm::Create(int64_t n, int64_t k,
                                                           size_t workspace_bytes,
                                                           cudaStream_t alloc_stream) {
  if (n <= 0) return absl::InvalidArgumentError(absl::StrCat("n must be positive, got ", n));
  if (k <= 0 || k % 8 != 0)
    return absl::InvalidArgumentError(absl::StrCat("k must be a positive multiple of 8, got ", k));
  auto impl = std::make_unique<Impl>();
  impl->n = n;
  impl->k = k;
  ULY_ASSIGN_OR_RETURN(impl->handle, LeasedHandle::Take());
  ULY_RETURN_IF_ERROR(impl->desc.Init(CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  ULY_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
      impl->desc.get(), CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof trans_a));
  ULY_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescSetAttribute(
      impl->desc.get(), CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof trans_b));
  ULY_ASSIGN_OR_RETURN(impl->w, internal::LtLayout::Create(k, n, k));
  impl->workspace_bytes = workspace_bytes;
  if (workspace_bytes > 0)
    ULY_RETURN_IF_ERROR(impl->workspace.Allocate(workspace_bytes, alloc_stream));
  return std::unique_ptr<Bf16Gemm>(new Bf16Gemm(std::move(impl)));
}

absl::Status Bf16Gemm::Prepare(int64_t m) {
  if (m <= 0) return absl::InvalidArgumentError(absl::StrCat("m must be positive, got ", m));
  ULY_ASSIGN_OR_RETURN(Impl::Shape * s, impl_->ForCall(m, 256));
  impl_->Choose(*s, m, 256);
  return absl::OkStatus();
}

absl::Status Bf16Gemm::Load(const std::vector<int64_t>& ms, const void* w, void* scratch,
                            size_t scratch_bytes, cudaStream_t stream, int64_t every_row_up_to) {
  if (w == nullptr) return absl::InvalidArgumentError("w must be non-null");
  const uint32_t w_alignment = AlignmentOf(w, w, w);
  if (w_alignment == 0) return absl::InvalidArgumentError("w must be 16-byte aligned");
  if (scratch == nullptr || reinterpret_cast<uintptr_t>(scratch) % 256 != 0)
    return absl::InvalidArgumentError("scratch must be non-null and 256-byte aligned");
  if (every_row_up_to < 0 || every_row_up_to > kMaxEveryRowLoad)
    return absl::InvalidArgumentError(absl::StrCat("every_row_up_to must be in [0, ",
                                                   kMaxEveryRowLoad, "], got ", every_row_up_to));
  Impl& g = *impl_;
  int64_t most = every_row_up_to;
  for (int64_t m : ms) {
    if (m <= 0)
      return absl::InvalidArgumentError(absl::StrCat("ms: row count ", m, " is not positive"));
    most = std::max(most, m);
  }
  if (most > 0) {
    // out at scratch; x after an offset of up to 128 bytes (the alignment classes below 256).
    const size_t rows = static_cast<size_t>(most);
    const size_t need = std::max(rows * static_cast<size_t>(g.n) * sizeof(uint16_t),
                                 128 + rows * static_cast<size_t>(g.k) * sizeof(uint16_t));
    if (scratch_bytes < need)
      return absl::InvalidArgumentError(absl::StrCat("scratch_bytes: ", scratch_bytes,
                                                     " bytes cannot hold ", most, " rows (", need,
                                                     " bytes needed)"));
  }
  // The most aligned class a call can have (w's alignment bounds every call's): an algorithm
  // must exist there for each of `ms`; the classes below it, and the every-row counts (a
  // speed-up), are best effort.
  const uint32_t top = std::min<uint32_t>(256, w_alignment);
  auto load = [&](int64_t m, uint32_t a, bool required) -> absl::Status {
    absl::StatusOr<Impl::Shape*> got = g.Get(m, a);
    // A call at a class or row count skipped here for want of an algorithm fails as before.
    if (!got.ok() && !required && absl::IsNotFound(got.status())) return absl::OkStatus();
    if (!got.ok())
      return absl::IsNotFound(got.status()) ? absl::InternalError(got.status().message())
                                            : got.status();
    Impl::Shape* s = *got;
    if (!g.Launched(s->algo, a)) {
      // x at an offset of `a` bytes (none for 256): the three pointers are aligned to `a` (w
      // is aligned to `a` at least: a <= w_alignment).
      const void* x = static_cast<const char*>(scratch) + (a < 256 ? a : 0);
      ULY_RETURN_IF_ERROR(g.Launch(s->algo, *s, x, w, scratch, stream));
      g.launched.emplace_back(s->algo, a);
      g.loaded_count.fetch_add(1, std::memory_order_relaxed);
    }
    // Recorded once launched, so that a failed Load pins no call to a kernel it never ran.
    g.loaded.emplace(std::make_pair(a, m), s->algo);
    return absl::OkStatus();
  };
  // Each of `ms` at every class a call can have, then every row count at the top class.
  for (int64_t m : ms) {
    for (uint32_t a : kAlignments) {
      if (a <= w_alignment) ULY_RETURN_IF_ERROR(load(m, a, a == top));  // no call is more aligned
    }
  }
  for (int64_t m = 1; m <= every_row_up_to; ++m) ULY_RETURN_IF_ERROR(load(m, top, false));
  ++g.generation;
  return absl::OkStatus();
}

size_t Bf16Gemm::loaded_algorithms() const {
  return impl_->loaded_count.load(std::memory_order_relaxed);
}
size_t Bf16Gemm::algorithm_queries() { return PickCache::Get().queries(); }
void Bf16Gemm::ForgetPicks() { PickCache::Get().Clear(); }
size_t Bf16Gemm::runs() const { return impl_->runs.load(std::memory_order_relaxed); }
size_t Bf16Gemm::unloaded_launches() const {
  return impl_->unloaded.load(std::memory_order_relaxed);
}

absl::Status Bf16Gemm::Run(const void* x, const void* w, void* out, int64_t m,
                           cudaStream_t stream) {
  if (m <= 0) return absl::InvalidArgumentError(absl::StrCat("m must be positive, got ", m));
  if (x == nullptr || w == nullptr || out == nullptr)
    return absl::InvalidArgumentError("x, w and out must be non-null");
  const uint32_t alignment = AlignmentOf(x, w, out);
  if (alignment == 0) return absl::InvalidArgumentError("x, w and out must be 16-byte aligned");
  ULY_ASSIGN_OR_RETURN(Impl::Shape * s, impl_->ForCall(m, alignment));
  const cublasLtMatmulAlgo_t& algo = impl_->Choose(*s, m, alignment);
  ULY_RETURN_IF_ERROR(impl_->Launch(algo, *s, x, w, out, stream));
  impl_->runs.fetch_add(1, std::memory_order_relaxed);
  impl_->CountLaunch(algo, alignment);
  return absl::OkStatus();
}

int64_t Bf16Gemm::n() const { return impl_->n; }
int64_t Bf16Gemm::k() const { return impl_->k; }
size_t Bf16Gemm::device_bytes() const { return impl_->workspace.bytes(); }

std::string Bf16Gemm::AlgoDescription(int64_t m) const {
  // The most aligned class asked for at m (256 unless w is less aligned).
  auto it = impl_->shapes.end();
  for (uint32_t a : kAlignments) {
    it = impl_->shapes.find({m, a});
    if (it != impl_->shapes.end()) break;
  }
  if (it == impl_->shapes.end()) return "";
  const Impl::Shape& s = it->second;
  // Once loaded, the choice made at the latest Load (Prepare makes it); before, cuBLASLt's.
  const cublasLtMatmulAlgo_t& algo =
      s.generation != 0 && s.generation == impl_->generation ? s.run : s.algo;
  int32_t id = 0, splitk = 0;
  uint32_t tile = 0, stages = 0;
  size_t written = 0;
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &written);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof tile,
                                       &written);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages,
                                       sizeof stages, &written);
  cublasLtMatmulAlgoConfigGetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk,
                                       sizeof splitk, &written);
  return absl::StrCat("cublasLt algo ", id, " tile ", tile, " stages ", stages, " split_k ",
                      splitk);
}

}  // namespace ulysses::kernels
