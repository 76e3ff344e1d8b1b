// Command lines of the programs (ulyssesd, ulyssesctl, ulysses-demo): one style for all.
// Defaults show in --help; a usage error is one line naming the option and the rule, and exits
// 64 (sysexits EX_USAGE). Header-only on top of CLI11: include it from programs that link
// CLI11::CLI11.
#pragma once

#include <charconv>
#include <cstdint>
#include <iostream>
#include <limits>
#include <optional>
#include <string>
#include <system_error>

#include "CLI/CLI.hpp"

namespace ulysses::cli {

/// Exit status of a bad command line (sysexits.h EX_USAGE).
inline constexpr int kExitUsage = 64;

/// Accepts a decimal integer in [lo, hi]. The error states the rule and the value given:
/// "must be an integer >= 1, got '0'" (CLI11 puts the option's name in front).
inline CLI::Validator IntIn(std::int64_t lo,
                            std::int64_t hi = std::numeric_limits<std::int64_t>::max()) {
  constexpr std::int64_t kMin = std::numeric_limits<std::int64_t>::min();
  constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();
  const std::string rule = lo == kMin && hi == kMax ? std::string("an integer")
                           : hi != kMax ? "an integer in [" + std::to_string(lo) + ", " +
                                         std::to_string(hi) + "]"
                                   : "an integer >= " + std::to_string(lo);
  return CLI::Validator(
      [lo, hi, rule](std::string& text) -> std::string {
        std::int64_t v = 0;
        const char* end = text.data() + text.size();
        const auto [ptr, ec] = std::from_chars(text.data(), end, v);
        if (ec != std::errc() || ptr != end || v < lo || v > hi)
          return "must be " + rule + ", got '" + text + "'";
        return {};
      },
      "");
}

/// Accepts any decimal integer ("must be an integer, got 'x'"); for options whose range the
/// program checks itself (with the config's rules).
inline CLI::Validator Integer() {
  return IntIn(std::numeric_limits<std::int64_t>::min(), std::numeric_limits<std::int64_t>::max())
      .description("");
}

/// Accepts a decimal number >= lo ("must be a number >= 0, got '-1'").
inline CLI::Validator NumberAtLeast(double lo) {
  return CLI::Validator(
      [lo](std::string& text) -> std::string {
        std::size_t used = 0;
        double v = 0;
        try {
          v = std::stod(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == 0 || used != text.size() || !(v >= lo))
          return "must be a number >= " + CLI::detail::to_string(lo) + ", got '" + text + "'";
        return {};
      },
      "");
}

/// The style every program uses: defaults shown in --help (options added after this call).
inline void Setup(CLI::App& app) { app.option_defaults()->always_capture_default(); }

/// Prints a usage error as one line on stderr, "PROG: MESSAGE (PROG --help shows the
/// usage)", and returns kExitUsage.
inline int UsageError(const std::string& program, const std::string& message) {
  std::cerr << program << ": " << message << " (" << program << " --help shows the usage)\n";
  return kExitUsage;
}

/// Parses the command line. Returns nullopt when the program should go on; otherwise the exit
/// status after --help or --version (0) or a usage error (kExitUsage, one line on stderr).
inline std::optional<int> Parse(CLI::App& app, int argc, char** argv,
                                const std::string& program) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == static_cast<int>(CLI::ExitCodes::Success)) return app.exit(e);
    return UsageError(program, e.what());
  }
  return std::nullopt;
}

}  // namespace ulysses::cli
