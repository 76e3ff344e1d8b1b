// ulyssesctl: asks one ulyssesd about its state, drains it (DESIGN.md section 7).
//
// Exit status: 0 success (health: SERVING), 1 the daemon answered with an error (health: any
// other status; drain --wait: not idle in time), 2 the daemon could not be reached, 64 bad
// usage.
#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "ulysses/common/cli.h"
#include "ulysses/common/sockets.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/channel.h"
#include "grpcpp/client_context.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "ulysses/proto/grpc_status.h"
#include "ulysses/v1/admin.grpc.pb.h"
#include "ulyssesctl/format.h"
#include "ulyssesctl/metrics.h"
#include "ulyssesctl/target.h"

namespace ulysses::ctl {
namespace {

constexpr int kExitOk = 0;
constexpr int kExitFailed = 1;
constexpr int kExitUnreachable = 2;

struct Options {
  std::string socket;
  OutputFormat format = OutputFormat::kTable;
  bool headers = true;
  std::int64_t timeout_ms = 5000;
  std::int32_t page_size = 0;  // entries per page of a listing (0: the daemon's default)
};

// What one answer prints as: the document for json and yaml, the listing for wide and csv
// (and for table unless `text` is set, which is what table prints).
struct View {
  nlohmann::json document;
  Listing listing;
  std::optional<std::string> text;
};

std::string Render(const View& view, const Options& options) {
  switch (options.format) {
    case OutputFormat::kJson:
      return view.document.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
    case OutputFormat::kYaml:
      return ToYaml(view.document);
    case OutputFormat::kTable:
      if (view.text) return *view.text;
      return view.listing.Render(options.format, options.headers);
    case OutputFormat::kWide:
    case OutputFormat::kCsv:
      return view.listing.Render(options.format, options.headers);
  }
  return "";
}

template <typename Request, typename Response>
using Method = grpc::Status (v1::Admin::Stub::*)(grpc::ClientContext*, const Request&, Response*);

class Ctl {
 public:
  explicit Ctl(const Options& options)
      : options_(options),
        daemon_(ChooseSocket(options.socket, std::getenv("ULYSSES_SOCKET"))),
        operator_(ChooseSocket(options.socket, std::getenv("ULYSSES_SOCKET")) +
                  std::string(kOperatorSocketSuffix)) {}

  // Calls Admin.`rpc` with `request` and prints the answer in the chosen format.
  template <typename Request, typename Response>
  int Admin(const char* rpc, Method<Request, Response> method, const Request& request,
            const std::function<View(const Response&)>& view) {
    Response response;
    const grpc::Status status = Call(method, request, &response);
    if (!status.ok()) return Fail(rpc, status);
    Print(view(response));
    return kExitOk;
  }

  // Admin with an empty request.
  template <typename Request, typename Response>
  int Admin(const char* rpc, Method<Request, Response> method,
            const std::function<View(const Response&)>& view) {
    return Admin(rpc, method, Request(), view);
  }

  // A listing, page after page (one call each), printed as one answer.
  template <typename Request, typename Response>
  int AdminList(const char* rpc, Method<Request, Response> method,
                const std::function<View(const Response&)>& view) {
    // Keys only grow from page to page; this bounds a listing that keeps growing as it is read.
    constexpr int kMaxPages = 100000;
    Response all;
    Request request;
    request.set_page_size(options_.page_size);
    for (int pages = 1;; ++pages) {
      Response page;
      const grpc::Status status = Call(method, request, &page);
      if (!status.ok()) return Fail(rpc, status);
      std::string next = page.next_page_token();
      page.clear_next_page_token();
      all.MergeFrom(page);
      if (next.empty()) break;
      if (next == request.page_token() || pages == kMaxPages) {
        std::cerr << "ulyssesctl: " << rpc << ": the listing did not end after " << pages
                  << " pages\n";
        return kExitFailed;
      }
      request.set_page_token(std::move(next));
    }
    Print(view(all));
    return kExitOk;
  }

  // Drain; with `wait`, then GetState every 100 ms until the daemon is idle, for at most
  // `wait_timeout_ms`.
  int Drain(bool wait, std::int64_t wait_timeout_ms) {
    v1::DrainResponse drained;
    grpc::Status status = Call(&v1::Admin::Stub::Drain, v1::DrainRequest(), &drained, operator_);
    if (!status.ok()) return Fail("Drain", status, operator_);
    if (!wait || drained.idle()) return PrintDrain(drained);
    if (options_.format == OutputFormat::kTable) std::cout << RenderDrain(drained) << std::flush;

    using Clock = std::chrono::steady_clock;
    constexpr auto kPollInterval = std::chrono::milliseconds(100);
    const auto deadline = Clock::now() + std::chrono::milliseconds(wait_timeout_ms);
    v1::DrainResponse last = drained;
    while (true) {
      const auto now = Clock::now();
      if (now >= deadline) {
        std::cerr << "ulyssesctl: drain: not idle after " << wait_timeout_ms
                  << " ms: " << RenderDrain(last);
        return kExitFailed;
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(kPollInterval, deadline - now));
      v1::DaemonState state;
      status = Call(&v1::Admin::Stub::GetState, v1::GetStateRequest(), &state);
      if (!status.ok()) return Fail("GetState", status);
      last = DrainFromState(state);
      if (!state.draining()) {
        std::cerr << "ulyssesctl: drain: the daemon stopped draining (undrained?) before it "
                     "was idle\n";
        return kExitFailed;
      }
      if (state.idle()) return PrintDrain(last);
    }
  }

  // Undrain, then the state in drain's form, so that both print the same fields.
  int Undrain() {
    v1::UndrainResponse undrained;
    grpc::Status status =
        Call(&v1::Admin::Stub::Undrain, v1::UndrainRequest(), &undrained, operator_);
    if (!status.ok()) return Fail("Undrain", status, operator_);
    v1::DaemonState state;
    status = Call(&v1::Admin::Stub::GetState, v1::GetStateRequest(), &state);
    if (!status.ok()) return Fail("GetState", status);
    return PrintDrain(DrainFromState(state));
  }

  int Metrics() {
    v1::GetMetricsResponse response;
    const grpc::Status status =
        Call(&v1::Admin::Stub::GetMetrics, v1::GetMetricsRequest(), &response);
    if (!status.ok()) return Fail("GetMetrics", status);
    View view{nlohmann::json(), Listing({{"NAME", "name"},
                                         {"LABELS", "labels"},
                                         {"VALUE", "value", Align::kRight},
                                         {"TIMESTAMP_MS", "timestamp_ms", Align::kRight}}),
              response.text()};
    if (!view.text->empty() && view.text->back() != '\n') *view.text += '\n';
    if (options_.format != OutputFormat::kTable) {
      std::vector<MetricSample> samples;
      std::string error;
      if (!ParseMetricsText(response.text(), &samples, &error)) {
        std::cerr << "ulyssesctl: GetMetrics: cannot parse the daemon's metrics: " << error
                  << '\n';
        return kExitFailed;
      }
      view.document = MetricsToJson(samples);
      for (const nlohmann::json& m : view.document["metrics"]) {
        std::string labels;
        for (const auto& [k, v] : m["labels"].items())
          labels += (labels.empty() ? "" : ",") + k + "=" + v.get<std::string>();
        std::string value = m["value"].is_string() ? m["value"].get<std::string>()
                                                    : m["value"].dump();
        // 40.0 -> 40: the exposition's own spelling of a whole number.
        if (value.size() > 2 && value.compare(value.size() - 2, 2, ".0") == 0)
          value.resize(value.size() - 2);
        view.listing.AddRow({m["name"].get<std::string>(), labels, value,
                             m.contains("timestamp_ms") ? m["timestamp_ms"].dump() : ""});
      }
    }
    Print(view);
    return kExitOk;
  }

  int Health() {
    auto stub = grpc::health::v1::Health::NewStub(daemon_.channel);
    grpc::ClientContext context;
    SetDeadline(context);
    grpc::health::v1::HealthCheckRequest request;
    request.set_service("");
    grpc::health::v1::HealthCheckResponse response;
    const grpc::Status status = stub->Check(&context, request, &response);
    if (!status.ok()) return Fail("Health.Check", status);
    const std::string name =
        grpc::health::v1::HealthCheckResponse::ServingStatus_Name(response.status());
    Print(View{HealthToJson(name), HealthListing(name), name + "\n"});
    return response.status() == grpc::health::v1::HealthCheckResponse::SERVING ? kExitOk
                                                                                 : kExitFailed;
  }

 private:
  // One socket of the daemon and the channel to it.
  struct Endpoint {
    explicit Endpoint(const std::string& socket)
        : address(ResolveSocket(socket)),
          channel(grpc::CreateChannel(address.target, grpc::InsecureChannelCredentials())) {}
    DaemonAddress address;
    std::shared_ptr<grpc::Channel> channel;
  };

  // Calls Admin.`method` on `at`: the control socket, or the operator socket for the calls
  // that change the daemon's state.
  template <typename Request, typename Response>
  grpc::Status Call(Method<Request, Response> method, const Request& request,
                    Response* response) {
    return Call(method, request, response, daemon_);
  }
  template <typename Request, typename Response>
  grpc::Status Call(Method<Request, Response> method, const Request& request, Response* response,
                    const Endpoint& at) {
    auto stub = v1::Admin::NewStub(at.channel);
    grpc::ClientContext context;
    SetDeadline(context);
    return ((*stub).*method)(&context, request, response);
  }

  int PrintDrain(const v1::DrainResponse& response) {
    Print(View{DrainToJson(response), DrainListing(response), RenderDrain(response)});
    return kExitOk;
  }

  void Print(const View& view) const {
    // Under --watch, json prints one compact document per line (JSON Lines), yaml one
    // document per round ("---" between), and the others a blank line between rounds.
    if (watching_ && options_.format == OutputFormat::kJson) {
      std::cout << view.document.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                << '\n';
    } else {
      if (watching_ && rounds_ > 0) std::cout << (options_.format == OutputFormat::kYaml ? "---\n" : "\n");
      std::cout << Render(view, options_);
    }
    std::cout << std::flush;
    ++rounds_;
  }

 public:
  // Runs `command` every `seconds` until SIGINT or SIGTERM (then exit 0). A round that fails
  // prints its error and the next round tries again, as watch(1) does.
  // `signals` (SIGINT, SIGTERM) are blocked in every thread: the caller blocked them before
  // the channel started its threads.
  int Watch(double seconds, const std::function<int(Ctl&)>& command, const sigset_t& signals) {
    const sigset_t set = signals;
    watching_ = true;
    const auto ns = static_cast<long long>(seconds * 1e9);
    for (;;) {
      (void)command(*this);
      timespec interval{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
      const int sig = sigtimedwait(&set, nullptr, &interval);
      if (sig == SIGINT || sig == SIGTERM) return kExitOk;
    }
  }

 private:

  void SetDeadline(grpc::ClientContext& context) const {
    context.set_deadline(std::chrono::system_clock::now() +
                         std::chrono::milliseconds(options_.timeout_ms));
  }

  int Fail(const char* rpc, const grpc::Status& status) { return Fail(rpc, status, daemon_); }
  int Fail(const char* rpc, const grpc::Status& status, const Endpoint& at) {
    if (IsUnreachable(status.error_code(), at.channel->GetState(false))) {
      std::cerr << "ulyssesctl: cannot reach ulyssesd at " << at.address.display << ": "
                << UnreachableReason(at.address, status, options_.timeout_ms) << '\n';
      return kExitUnreachable;
    }
    std::cerr << "ulyssesctl: " << rpc << ": " << FromGrpcStatus(status).ToString() << '\n';
    return kExitFailed;
  }

  Options options_;
  Endpoint daemon_;    // the control socket: every read-only query
  Endpoint operator_;  // the operator socket: drain and undrain
  bool watching_ = false;
  mutable int rounds_ = 0;
};

std::int64_t NowUnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

constexpr const char* kCommands =
    "status, clients, groups, sessions, slots, recent, drain, undrain, metrics, health";

int Main(int argc, char** argv) {
  CLI::App app("Ask a ulyssesd daemon about its state.", "ulyssesctl");
  cli::Setup(app);
  app.set_version_flag("--version", ULYSSES_VERSION);
  // Global options may also follow the command: `ulyssesctl clients -o json`.
  app.fallthrough();
  app.require_subcommand(0, 1);
  // Unknown words are collected (and refused below with a message that says what they are).
  app.allow_extras();
  app.footer(
      "Commands: status, clients, groups, sessions, slots, recent [--limit N], drain [--wait "
      "[--wait-timeout-ms N]], undrain, metrics, health.\n"
      "Output (-o): table (default; human units, local RFC 3339 times), wide (more columns), "
      "json, yaml (one document; times as RFC 3339 UTC *_time, durations as *_seconds, sizes "
      "as *_bytes), csv (raw numbers, the unit in the column name).\n"
      "Exit status: 0 success (health: SERVING), 1 the daemon answered with an error (health: "
      "any other status; drain --wait: not idle in time), 2 the daemon could not be reached, "
      "64 bad usage.");
  Options options;
  app.add_option("--socket", options.socket,
                 "Daemon socket: a path or a unix: target (default: $ULYSSES_SOCKET, else " +
                     std::string(kDefaultSocket) + ")");
  std::string format_name = "table";
  CLI::Option* output =
      app.add_option("-o,--output", format_name, "table | wide | json | yaml | csv")
          ->check(CLI::Validator(
              [](std::string& f) -> std::string {
                return ParseOutputFormat(f) ? std::string()
                                            : "'" + f + "' is not table, wide, json, yaml or csv";
              },
              ""));
  bool json_flag = false;
  app.add_flag("--json", json_flag, "The same as -o json")->excludes(output);
  bool no_headers = false;
  app.add_flag("--no-headers", no_headers, "Leave out the header line of table, wide and csv");
  double watch_seconds = 0;
  CLI::Option* watch =
      app.add_option("--watch", watch_seconds,
                     "Print again every SECONDS (> 0) until interrupted; json prints one line "
                     "per round")
          ->check(CLI::Validator(
              [](std::string& t) -> std::string {
                std::size_t used = 0;
                double v = 0;
                try {
                  v = std::stod(t, &used);
                } catch (const std::exception&) {
                  used = 0;
                }
                return used == t.size() && used > 0 && v > 0 && v <= 86400
                           ? std::string()
                           : "must be a number of seconds in (0, 86400], got '" + t + "'";
              },
              ""))
          ->default_str("off");
  app.add_option("--timeout-ms", options.timeout_ms, "Deadline of each call in milliseconds")
      ->check(cli::IntIn(1));
  app.add_option("--page-size", options.page_size,
                 "Entries per call of a listing (clients, groups, sessions, slots), which is "
                 "read page after page; 0: the daemon's default (500); at most 1000")
      ->check(cli::IntIn(0, 1000));

  std::function<int(Ctl&)> command;
  std::string command_name;
  auto add = [&](const char* name, const char* help, std::function<int(Ctl&)> run) {
    CLI::App* sub = app.add_subcommand(name, help);
    sub->callback([&command, &command_name, name, run] {
      command = run;
      command_name = name;
    });
    return sub;
  };
  add("status",
      "Daemon state: version, device and its GPU identity, backend, MPS mode, health, "
      "draining, idle, counts, metrics address",
      [](Ctl& c) {
        return c.Admin<v1::GetStateRequest, v1::DaemonState>(
            "GetState", &v1::Admin::Stub::GetState, [](const v1::DaemonState& r) {
              return View{StateToJson(r), StateListing(r), RenderState(r)};
            });
      });
  add("clients", "Attached clients", [](Ctl& c) {
    return c.AdminList<v1::ListClientsRequest, v1::ListClientsResponse>(
        "ListClients", &v1::Admin::Stub::ListClients, [](const v1::ListClientsResponse& r) {
          return View{ClientsToJson(r), ClientsListing(r, NowUnixMs()), std::nullopt};
        });
  });
  add("groups", "Groups this daemon's clients joined", [](Ctl& c) {
    return c.AdminList<v1::ListGroupsRequest, v1::ListGroupsResponse>(
        "ListGroups", &v1::Admin::Stub::ListGroups, [](const v1::ListGroupsResponse& r) {
          return View{GroupsToJson(r), GroupsListing(r), std::nullopt};
        });
  });
  add("sessions", "Head-exchange sessions", [](Ctl& c) {
    return c.AdminList<v1::ListSessionsRequest, v1::ListSessionsResponse>(
        "ListSessions", &v1::Admin::Stub::ListSessions, [](const v1::ListSessionsResponse& r) {
          return View{SessionsToJson(r), SessionsListing(r), std::nullopt};
        });
  });
  add("slots", "Receive slots of every session", [](Ctl& c) {
    return c.AdminList<v1::ListSlotsRequest, v1::ListSlotsResponse>(
        "ListSlots", &v1::Admin::Stub::ListSlots, [](const v1::ListSlotsResponse& r) {
          return View{SlotsToJson(r), SlotsListing(r), std::nullopt};
        });
  });
  std::int32_t recent_limit = 0;
  add("recent", "The flight recorder: the daemon's most recent calls, newest first",
      [&recent_limit](Ctl& c) {
        v1::ListRecentCallsRequest request;
        request.set_limit(recent_limit);
        return c.Admin<v1::ListRecentCallsRequest, v1::ListRecentCallsResponse>(
            "ListRecentCalls", &v1::Admin::Stub::ListRecentCalls, request,
            [](const v1::ListRecentCallsResponse& r) {
              return View{RecentCallsToJson(r), RecentCallsListing(r), std::nullopt};
            });
      })
      ->add_option("--limit", recent_limit, "At most this many calls (0: all the recorder holds)")
      ->check(cli::IntIn(0, std::numeric_limits<std::int32_t>::max()));
  bool drain_wait = false;
  std::int64_t drain_wait_timeout_ms = 60000;
  CLI::App* drain = add(
      "drain",
      "Stop taking new clients and sessions (health NOT_SERVING); running sessions keep working",
      [&drain_wait, &drain_wait_timeout_ms](Ctl& c) {
        return c.Drain(drain_wait, drain_wait_timeout_ms);
      });
  CLI::Option* wait_flag = drain->add_flag(
      "--wait", drain_wait, "Then wait until no call is running (polls every 100 ms)");
  drain
      ->add_option("--wait-timeout-ms", drain_wait_timeout_ms,
                   "Give up waiting after this long (exit 1)")
      ->check(cli::IntIn(1))
      ->needs(wait_flag);
  add("undrain", "Take new clients and sessions again (health SERVING)",
      [](Ctl& c) { return c.Undrain(); });
  add("metrics", "The daemon's metrics (Prometheus text; json, yaml, csv: parsed samples)",
      [](Ctl& c) { return c.Metrics(); });
  add("health", "grpc.health.v1 check: prints SERVING or NOT_SERVING; exit 0 only when SERVING",
      [](Ctl& c) { return c.Health(); });

  if (std::optional<int> rc = cli::Parse(app, argc, argv, "ulyssesctl")) return *rc;
  const std::vector<std::string> rest = app.remaining(true);
  const bool option = !rest.empty() && !rest.front().empty() && rest.front()[0] == '-';
  if (option)
    return cli::UsageError("ulyssesctl", "unknown option '" + rest.front() + "'" +
                                             (command ? " for " + command_name : std::string()));
  if (!command && !rest.empty())
    return cli::UsageError("ulyssesctl", "unknown command '" + rest.front() + "' (commands: " +
                                             kCommands + ")");
  if (!command)
    return cli::UsageError("ulyssesctl", std::string("a command is required (") + kCommands + ")");
  if (!rest.empty())
    return cli::UsageError("ulyssesctl",
                           "unexpected argument '" + rest.front() + "' after " + command_name);
  options.format = json_flag ? OutputFormat::kJson : *ParseOutputFormat(format_name);
  options.headers = !no_headers;
  if (watch->count() && (command_name == "drain" || command_name == "undrain"))
    return cli::UsageError("ulyssesctl", "--watch: not for " + command_name +
                                             " (it changes the daemon); use it with status, "
                                             "clients, groups, sessions, slots, recent, "
                                             "metrics or health");
  if (!watch->count()) {
    Ctl ctl(options);
    return command(ctl);
  }
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  Ctl ctl(options);
  return ctl.Watch(watch_seconds, command, signals);
}

}  // namespace
}  // namespace ulysses::ctl

int main(int argc, char** argv) { return ulysses::ctl::Main(argc, argv); }
