// The daemon's configuration: a node config (JSON text) and a command line, taken through
// the steps ulyssesd's main takes (the flags over the defaults, the file, the file with the
// flags applied), with the daemon's own flag definitions. A parsed config serves the device
// it was parsed for.
#include <string>
#include <vector>

#include "flags.h"
#include "fuzz_util.h"
#include "ulysses/common/config.h"

using namespace ulysses;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const int32_t device = in.ConsumeIntegralInRange<int32_t>(0, 9);
  std::vector<std::string> args{"ulyssesd"};
  const int nargs = in.ConsumeIntegralInRange<int>(0, 8);
  for (int i = 0; i < nargs; ++i) args.push_back(in.ConsumeRandomLengthString(64));
  const std::string json = in.ConsumeRemainingBytesAsString();

  // One command line for every input, as building one costs more than parsing with it; each
  // parse starts from a cleared state, and only the flags given this time apply.
  static daemon::DaemonFlags& f = *new daemon::DaemonFlags;
  static CLI::App& app = [] () -> CLI::App& {
    auto* a = new CLI::App("ulyssesd");
    daemon::AddDaemonFlags(*a, f);
    return *a;
  }();
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  try {
    app.clear();
    f.device = 0;  // the one flag that applies even when not given (as its default)
    app.parse(static_cast<int>(argv.size()), argv.data());
  } catch (const CLI::ParseError&) {
    return 0;  // a usage error (or --help), as ulysses::cli::Parse reports it
  }
  DaemonConfig flags_only;
  f.ApplyTo(flags_only);
  if (!ValidateDaemonConfig(flags_only).ok()) return 0;
  absl::StatusOr<DaemonConfig> config = ParseDaemonConfig(json, device);
  if (!config.ok()) return 0;
  if (config->device != device || config->socket.empty())
    fuzz::Fail("a parsed config names another device or no socket");
  f.ApplyTo(*config);
  (void)ValidateDaemonConfig(*config);
  return 0;
}
