#include "demo_lib.h"

#include "ulysses/ipc/cuda_memory.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <thread>

#include "ulysses/client/client.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"

namespace ulysses::demo {
namespace fs = std::filesystem;

DaemonProcess::~DaemonProcess() {
  if (pid_ > 0) (void)Stop(absl::Seconds(5));
}

DaemonProcess& DaemonProcess::operator=(DaemonProcess&& o) noexcept {
  if (this != &o) {
    if (pid_ > 0) (void)Stop(absl::Seconds(5));
    pid_ = o.pid_;
    socket_ = std::move(o.socket_);
    o.pid_ = -1;
  }
  return *this;
}

absl::StatusOr<int> DaemonProcess::Stop(absl::Duration grace) {
  if (pid_ <= 0) return absl::FailedPreconditionError("daemon: not running");
  ::kill(pid_, SIGTERM);
  const absl::Time deadline = absl::Now() + grace;
  int status = 0;
  for (;;) {
    pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) break;
    if (r < 0) return ErrnoError("waitpid", errno);
    if (absl::Now() > deadline) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
      pid_ = -1;
      return absl::DeadlineExceededError(StrCat("daemon did not exit within ", absl::FormatDuration(grace)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  pid_ = -1;
  return status;
}

absl::StatusOr<int> DaemonProcess::WaitExit(absl::Duration timeout) {
  if (pid_ <= 0) return absl::FailedPreconditionError("daemon: not running");
  const absl::Time deadline = absl::Now() + timeout;
  for (;;) {
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      pid_ = -1;
      return status;
    }
    if (r < 0) return ErrnoError("waitpid", errno);
    if (absl::Now() > deadline)
      return absl::DeadlineExceededError(
          StrCat("daemon still running after ", absl::FormatDuration(timeout)));
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

void DaemonProcess::Kill() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  ::waitpid(pid_, nullptr, 0);
  pid_ = -1;
}

std::string SiblingProgram(const std::string& name) {
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    for (fs::path dir : {self.parent_path(), self.parent_path().parent_path() / "daemon",
                         self.parent_path().parent_path().parent_path() / "daemon",
                         self.parent_path().parent_path() / "bin"}) {
      if (fs::exists(dir / name)) return (dir / name).string();
    }
  }
  return name;
}

absl::StatusOr<std::string> MakeRunDir() {
  char tmpl[] = "/tmp/ulysses.XXXXXX";
  if (!::mkdtemp(tmpl)) return ErrnoError("mkdtemp", errno);
  return std::string(tmpl);
}

void RemoveRunDir(const std::string& dir) {
  std::error_code ec;
  fs::remove_all(dir, ec);
}

absl::StatusOr<DaemonProcess> StartDaemon(const std::string& ulyssesd, const std::string& dir,
                                          int device, const std::string& backend,
                                          const std::vector<std::string>& extra_args,
                                          absl::Duration timeout,
                                          const std::vector<std::string>& env) {
  const std::string socket = StrCat(dir, "/gpu", device, ".sock");
  const std::string ready = StrCat(dir, "/gpu", device, ".ready");
  const std::string log = StrCat(dir, "/gpu", device, ".log");
  // On a machine with GPUs, ranks go round the GPUs present (several ranks share a GPU when
  // there are more ranks than GPUs); `device` also names the rank's socket.
  const int gpus = ipc::cuda::DeviceCount();
  const int cuda_device = gpus > 0 && backend != "host" ? device % gpus : device;
  // A ready file left by a killed instance would pass for this one's: the wait below must see
  // the new instance's own (the daemon removes a stale one too, but only once it runs).
  if (::unlink(ready.c_str()) != 0 && errno != ENOENT) return ErrnoError("unlink " + ready, errno);
  std::vector<std::string> args = {ulyssesd, "--device", std::to_string(cuda_device), "--socket",
                                   socket, "--backend", backend, "--ready-file", ready};
  args.insert(args.end(), extra_args.begin(), extra_args.end());
  // The child's environment, made before fork (the child of a threaded process must not
  // allocate): this process's, with `env` replacing variables of the same name.
  std::vector<std::string> environment = env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const std::string_view name = entry.substr(0, entry.find('=') + 1);
    if (std::none_of(env.begin(), env.end(), [&](const std::string& v) { return v.starts_with(name); }))
      environment.emplace_back(entry);
  }
  std::vector<char*> envp;
  for (auto& e : environment) envp.push_back(e.data());
  envp.push_back(nullptr);
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t launcher = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) return ErrnoError("fork", errno);
  if (pid == 0) {
    // The daemon goes with its launcher (the demo, a bench, a test): one killed by a timeout
    // leaves no daemon behind holding its socket, its GPU memory or an MPS server. SIGTERM,
    // so it drains and stops as on any shutdown. The launcher may already be gone.
    if (::prctl(PR_SET_PDEATHSIG, SIGTERM) != 0 || ::getppid() != launcher) _exit(127);
    int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) {
      ::dup2(fd, 2);
      ::close(fd);
    }
    ::execve(argv[0], argv.data(), envp.data());
    if (std::strchr(argv[0], '/') == nullptr) ::execvpe(argv[0], argv.data(), envp.data());
    // Into the log, which the parent shows: why the program did not start.
    const std::string why = StrCat("cannot run ", args[0], ": ", std::strerror(errno), "\n");
    (void)!::write(2, why.data(), why.size());
    _exit(127);
  }
  DaemonProcess proc(pid, socket);
  const absl::Time deadline = absl::Now() + timeout;
  // The ready file is renamed into place once the daemon serves.
  while (::access(ready.c_str(), F_OK) != 0) {
    int status = 0;
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      std::string tail;
      FILE* f = ::fopen(log.c_str(), "r");
      if (f) {
        char buf[4096];
        size_t n = ::fread(buf, 1, sizeof buf - 1, f);
        tail.assign(buf, n);
        ::fclose(f);
      }
      proc = DaemonProcess();
      while (!tail.empty() && (tail.back() == '\n' || tail.back() == ' ')) tail.pop_back();
      const std::string how = WIFSIGNALED(status) ? StrCat("killed by signal ", WTERMSIG(status))
                                                  : StrCat("exit status ", WEXITSTATUS(status));
      return absl::UnavailableError(StrCat("ulyssesd (device ", device, ") exited before serving (",
                                           how, "): ", tail.empty() ? "no output" : tail));
    }
    if (absl::Now() > deadline) {
      proc.Kill();
      return absl::DeadlineExceededError(StrCat("ulyssesd (device ", device, ") not ready within ",
                                                absl::FormatDuration(timeout)));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return proc;
}

uint32_t PatternBits(int rank, int tensor, uint64_t index, int itemsize) {
  uint64_t h = index * 0x9E3779B97F4A7C15ull ^ (static_cast<uint64_t>(rank) << 48) ^
               (static_cast<uint64_t>(tensor) << 40);
  h ^= h >> 31;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 29;
  const uint32_t r = static_cast<uint32_t>(h);
  // Finite values in (-2, -1] U [1, 2): sign and mantissa vary, the exponent is fixed.
  if (itemsize == 2) return (r & 0x807Fu) | 0x3F80u;  // bf16 and fp16 alike: finite
  return (r & 0x807FFFFFu) | 0x3F800000u;
}

std::vector<int32_t> DefaultSchedule(int32_t hl) {
  if (hl == 14) return {2, 10, 2};
  if (hl == 28) return {7, 14, 7};
  if (hl >= 3) {
    const int32_t l = std::max(1, hl / 4);
    return {l, hl - 2 * l, l};
  }
  return std::vector<int32_t>(hl, 1);
}

nlohmann::json RankReport::ToJson() const {
  return {{"rank", rank}, {"ok", ok},          {"error", error},   {"checks", checks},
          {"calls", calls}, {"p50_us", p50_us}, {"max_us", max_us}, {"backend", backend}, {"mps", mps}};
}

namespace {

void Store(void* base, uint64_t elem, int itemsize, uint32_t bits) {
  if (itemsize == 2) {
    uint16_t v = static_cast<uint16_t>(bits);
    std::memcpy(static_cast<uint8_t*>(base) + elem * 2, &v, 2);
  } else {
    std::memcpy(static_cast<uint8_t*>(base) + elem * 4, &bits, 4);
  }
}

uint32_t Load(const void* base, uint64_t elem, int itemsize) {
  if (itemsize == 2) {
    uint16_t v;
    std::memcpy(&v, static_cast<const uint8_t*>(base) + elem * 2, 2);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, static_cast<const uint8_t*>(base) + elem * 4, 4);
  return v;
}

// A buffer and a host copy of it: on a GPU backend the buffer is device memory, so the
// workload fills and checks the host copy and moves it with Upload/Download.
class Staged {
 public:
  explicit Staged(client::Buffer b) : b_(b) {
    if (b_.device) host_.resize(b_.size);
  }
  void* host() { return b_.device ? host_.data() : b_.data; }
  absl::Status Upload() { return b_.device ? ipc::cuda::Copy(b_.data, host_.data(), b_.size) : absl::OkStatus(); }
  absl::Status Download() { return b_.device ? ipc::cuda::Copy(host_.data(), b_.data, b_.size) : absl::OkStatus(); }
  const client::Buffer& buffer() const { return b_; }

 private:
  client::Buffer b_;
  std::vector<uint8_t> host_;
};

// A host-readable copy of a result (itself on a host backend).
absl::StatusOr<const void*> HostCopy(const client::Result& r, std::vector<uint8_t>* scratch) {
  if (!r.device) return r.data;
  scratch->resize(r.bytes);
  ULY_RETURN_IF_ERROR(ipc::cuda::Copy(scratch->data(), r.data, r.bytes));
  return static_cast<const void*>(scratch->data());
}

// Bytes between two buffers of either kind.
absl::Status CopyBytes(void* dst, const void* src, size_t n, bool device) {
  if (device) return ipc::cuda::Copy(dst, src, n);
  std::memcpy(dst, src, n);
  return absl::OkStatus();
}

#define ULY_DEMO_TIMED(expr) Timed([&] { return expr; })

class Runner {
 public:
  explicit Runner(const Workload& w) : w_(w) {}

  absl::Status Run(RankReport* report) {
    const int W = w_.world_size, r = w_.rank, es = ItemSize(w_.dtype);
    const int64_t B = w_.batch, SL = w_.seq_local, SG = SL * W, H = w_.num_heads, D = w_.head_dim;
    const int64_t HL = H / W;
    ULY_ASSIGN_OR_RETURN(client_, client::Client::Connect(
                                      {w_.socket, StrCat("demo-rank-", r), absl::Seconds(30)}));
    report->backend = client_->daemon_backend();
    report->mps = client_->daemon_mps_mode();
    client::GroupSpec gs{w_.group, W, r, w_.members, w_.backend, 0};
    ULY_ASSIGN_OR_RETURN(client::Group group, client_->JoinGroup(gs));
    std::vector<int32_t> schedule = w_.schedule.empty() ? DefaultSchedule(HL) : w_.schedule;
    client::SessionSpec spec{static_cast<int32_t>(H), static_cast<int32_t>(D), w_.dtype, B * SL, 2,
                             schedule, 0};
    ULY_ASSIGN_OR_RETURN(auto session, client_->CreateSession(group, spec));

    const uint64_t n_x = B * SL * H * D;
    ULY_ASSIGN_OR_RETURN(client::Buffer xb, client_->AllocBuffer(n_x * es, "x"));
    ULY_ASSIGN_OR_RETURN(client::Buffer y, client_->AllocBuffer(B * SG * HL * D * es, "y"));
    ULY_ASSIGN_OR_RETURN(client::Buffer goutb, client_->AllocBuffer(n_x * es, "gathered"));
    ULY_ASSIGN_OR_RETURN(client::Buffer qkvb, client_->AllocBuffer(3 * n_x * es, "qkv"));
    ULY_ASSIGN_OR_RETURN(client::Buffer chunkb, client_->AllocBuffer(B * SG * HL * D * es, "chunk"));
    ULY_ASSIGN_OR_RETURN(client::Buffer ob, client_->AllocBuffer(n_x * es, "o"));
    Staged x(xb), gout(goutb), qkv(qkvb), chunk(chunkb), o(ob);
    for (uint64_t i = 0; i < n_x; ++i) Store(x.host(), i, es, PatternBits(r, 0, i, es));
    for (uint64_t i = 0; i < 3 * n_x; ++i) Store(qkv.host(), i, es, PatternBits(r, 1, i, es));
    ULY_RETURN_IF_ERROR(x.Upload());
    ULY_RETURN_IF_ERROR(qkv.Upload());
    // q, k, v: non-contiguous views of one [B,S_l,H,3,D] buffer.
    const std::array<int64_t, 4> qkv_strides{SL * H * 3 * D, H * 3 * D, 3 * D, 1};
    const OperandRef q = qkvb.Ref(0, qkv_strides), k = qkvb.Ref(D * es, qkv_strides),
                     v = qkvb.Ref(2 * D * es, qkv_strides);
    const uint32_t nan_bits = es == 2 ? 0x7FC1u : 0x7FC00001u;
    std::vector<uint8_t> scratch;

    for (int it = 0; it < w_.iterations; ++it) {
      // 1. scatter_heads: rank r gets heads [r*H_l, (r+1)*H_l) of every rank's tokens.
      ULY_ASSIGN_OR_RETURN(client::Result sc, ULY_DEMO_TIMED(session->ScatterHeads(xb.Ref(), B, SL)));
      ULY_ASSIGN_OR_RETURN(const void* sc_host, HostCopy(sc, &scratch));
      for (int64_t b = 0; b < B; ++b)
        for (int64_t g = 0; g < SG; ++g)
          for (int64_t h = 0; h < HL; ++h)
            for (int64_t d = 0; d < D; ++d) {
              const int64_t j = g / SL, s = g % SL;
              const uint64_t src = ((b * SL + s) * H + r * HL + h) * D + d;
              const uint64_t dst = ((b * SG + g) * HL + h) * D + d;
              ULY_RETURN_IF_ERROR(Check(Load(sc_host, dst, es), PatternBits(j, 0, src, es),
                                        "scatter_heads", dst));
            }
      // 2. identity attention, 3. gather_heads back into this rank's tokens, all heads.
      ULY_RETURN_IF_ERROR(CopyBytes(y.data, sc.data, B * SG * HL * D * es, y.device));
      ULY_RETURN_IF_ERROR(sc.Release());  // the band is copied: give the slot back
      ULY_ASSIGN_OR_RETURN(client::Result ga, ULY_DEMO_TIMED(session->GatherHeads(y.Ref(), B, SG, goutb.Ref())));
      (void)ga;
      ULY_RETURN_IF_ERROR(gout.Download());
      for (uint64_t i = 0; i < n_x; ++i)
        ULY_RETURN_IF_ERROR(Check(Load(gout.host(), i, es), Load(x.host(), i, es), "gather_heads", i));
      // 4. head-chunk path over the schedule, merged into a NaN-filled output.
      for (uint64_t i = 0; i < n_x; ++i) Store(o.host(), i, es, nan_bits);
      ULY_RETURN_IF_ERROR(o.Upload());
      int32_t offset = 0;
      for (int32_t hc : schedule) {
        ULY_ASSIGN_OR_RETURN(client::Result qc,
                             ULY_DEMO_TIMED(session->ScatterQkvHeadChunk(q, k, v, B, SL, offset, hc)));
        ULY_ASSIGN_OR_RETURN(const void* qc_host, HostCopy(qc, &scratch));
        for (int64_t b = 0; b < B; ++b)
          for (int64_t g = 0; g < SG; ++g)
            for (int64_t c = 0; c < hc; ++c)
              for (int64_t part = 0; part < 3; ++part)
                for (int64_t d = 0; d < D; ++d) {
                  const int64_t j = g / SL, s = g % SL;
                  const uint64_t src = (((b * SL + s) * H + r * HL + offset + c) * 3 + part) * D + d;
                  const uint64_t dst = ((b * SG + g) * hc + c) * 3 * D + part * D + d;
                  ULY_RETURN_IF_ERROR(Check(Load(qc_host, dst, es), PatternBits(j, 1, src, es),
                                            "scatter_qkv_head_chunk", dst));
                  if (part == 0)  // identity attention: the output is the query
                    Store(chunk.host(), ((b * SG + g) * hc + c) * D + d, es, Load(qc_host, dst, es));
                }
        ULY_RETURN_IF_ERROR(chunk.Upload());
        ULY_ASSIGN_OR_RETURN(client::Result gc, ULY_DEMO_TIMED(session->GatherOutputHeadChunk(
                                                    chunkb.Ref(), B, SG, offset, hc, ob.Ref())));
        (void)gc;
        offset += hc;
      }
      ULY_RETURN_IF_ERROR(o.Download());
      for (int64_t b = 0; b < B; ++b)
        for (int64_t s = 0; s < SL; ++s)
          for (int64_t h = 0; h < H; ++h)
            for (int64_t d = 0; d < D; ++d) {
              const uint64_t oi = ((b * SL + s) * H + h) * D + d;
              const uint64_t qi = (((b * SL + s) * H + h) * 3 + 0) * D + d;
              ULY_RETURN_IF_ERROR(Check(Load(o.host(), oi, es), Load(qkv.host(), qi, es),
                                        "gather_output_head_chunk", oi));
            }
    }
    if (w_.hold_seconds > 0)
      std::this_thread::sleep_for(std::chrono::duration<double>(w_.hold_seconds));
    if (absl::Status s = session->Close(); !s.ok())
      return absl::Status(s.code(), StrCat("after every call was verified, closing the session: ",
                                           s.message()));
    if (absl::Status s = client_->Close(); !s.ok())
      return absl::Status(s.code(), StrCat("after every call was verified, closing the client: ",
                                           s.message()));
    return absl::OkStatus();
  }

  // What the rank did, whether or not it got to the end.
  void Summarize(RankReport* report) {
    std::sort(times_.begin(), times_.end());
    report->calls = static_cast<int64_t>(times_.size());
    if (!times_.empty()) {
      report->p50_us = times_[times_.size() / 2];
      report->max_us = times_.back();
    }
    report->checks = checks_;
  }

 private:
  template <typename F>
  absl::StatusOr<client::Result> Timed(F&& call) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::StatusOr<client::Result> r = call();
    times_.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    return r;
  }

  absl::Status Check(uint32_t got, uint32_t want, const char* what, uint64_t index) {
    ++checks_;
    if (got == want) return absl::OkStatus();
    return absl::DataLossError(StrCat(what, ": element ", index, " is 0x", std::hex, got,
                                      ", expected 0x", want));
  }

  const Workload& w_;
  std::unique_ptr<client::Client> client_;
  std::vector<double> times_;
  int64_t checks_ = 0;

  friend RankReport ulysses::demo::RunRank(const Workload& w);
};

}  // namespace

RankReport RunRank(const Workload& w) {
  RankReport report;
  report.rank = w.rank;
  Runner runner(w);
  absl::Status s = runner.Run(&report);
  runner.Summarize(&report);
  report.ok = s.ok();
  if (!s.ok()) report.error = StrCat(absl::StatusCodeToString(s.code()), ": ", s.message());
  return report;
}

}  // namespace ulysses::demo
