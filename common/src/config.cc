#include "ulysses/common/config.h"

#include <grp.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <set>
#include <span>
#include <sstream>

#include "absl/strings/numbers.h"
#include "ulysses/common/strings.h"
#include "nlohmann/json.hpp"
#include "ulysses/common/logging.h"
#include "ulysses/common/status.h"

namespace ulysses {
namespace {

using json = nlohmann::json;

absl::Status CheckKeys(const json& obj, std::string_view where,
                       const std::set<std::string>& allowed) {
  if (!obj.is_object())
    return absl::InvalidArgumentError(StrCat(where.empty() ? "config" : where,
                                                   ": expected an object"));
  for (const auto& [key, value] : obj.items()) {
    if (!allowed.count(key))
      return absl::InvalidArgumentError(
          StrCat(where.empty() ? "" : StrCat(where, "."), key, ": unknown key"));
  }
  return absl::OkStatus();
}

template <typename T>
absl::Status Read(const json& obj, const std::string& key, std::string_view where, T* out) {
  if (!obj.contains(key)) return absl::OkStatus();
  const json& v = obj.at(key);
  const std::string name = where.empty() ? key : StrCat(where, ".", key);
  if constexpr (std::is_same_v<T, std::string>) {
    if (!v.is_string()) return absl::InvalidArgumentError(StrCat(name, ": expected a string"));
  } else {
    if (!v.is_number_integer())
      return absl::InvalidArgumentError(StrCat(name, ": expected an integer"));
    if constexpr (std::is_unsigned_v<T>) {
      if (v.is_number_unsigned()) {
        if (v.get<uint64_t>() > std::numeric_limits<T>::max())
          return absl::InvalidArgumentError(StrCat(name, ": out of range"));
      } else if (v.get<int64_t>() < 0) {
        return absl::InvalidArgumentError(StrCat(name, ": must not be negative"));
      }
    } else {
      if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<T>::max())
                                 : (v.get<int64_t>() > static_cast<int64_t>(std::numeric_limits<T>::max()) ||
                                    v.get<int64_t>() < static_cast<int64_t>(std::numeric_limits<T>::min())))
        return absl::InvalidArgumentError(StrCat(name, ": out of range"));
    }
  }
  *out = v.get<T>();
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<uint32_t> ResolveGroup(std::string_view group) {
  if (group.empty() || group.size() > 256)
    return absl::InvalidArgumentError("a group name or a gid, 1 to 256 characters");
  if (std::all_of(group.begin(), group.end(), [](char ch) { return ch >= '0' && ch <= '9'; })) {
    uint32_t gid = 0;
    if (!absl::SimpleAtoi(absl::string_view(group.data(), group.size()), &gid) ||
        gid == std::numeric_limits<uint32_t>::max())
      return absl::InvalidArgumentError(StrCat("gid ", group, " is out of range"));
    return gid;
  }
  const std::string name(group);
  for (size_t size = 16384;; size *= 4) {
    std::vector<char> buf(size);
    struct group entry {};
    struct group* found = nullptr;
    const int rc = ::getgrnam_r(name.c_str(), &entry, buf.data(), buf.size(), &found);
    if (rc == ERANGE && size < (1u << 20)) continue;  // a group with many members: more room
    if (rc != 0)
      return absl::InvalidArgumentError(StrCat("looking up group '", name, "': ", std::strerror(rc)));
    if (found == nullptr) return absl::InvalidArgumentError(StrCat("no group named '", name, "'"));
    return static_cast<uint32_t>(found->gr_gid);
  }
}

std::string DefaultSocketPath(int32_t index) {
  return StrCat("/run/ulysses/gpu", index, ".sock");
}

absl::StatusOr<DaemonConfig> ParseDaemonConfig(const std::string& json_text, int32_t device) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    // Malformed text (parse_error), and also a number beyond a double's range (out_of_range),
    // which the parser throws as a different type.
    return absl::InvalidArgumentError(StrCat("config: not valid JSON: ", e.what()));
  }
  ULY_RETURN_IF_ERROR(CheckKeys(root, "", {"log_level", "backend", "timeouts", "slots",
                                           "metrics", "ready_file", "devices",
                                           "flight_recorder_size", "limits", "rings",
                                           "admin", "queues", "fused"}));
  DaemonConfig c;
  c.device = device;
  ULY_RETURN_IF_ERROR(Read(root, "flight_recorder_size", "", &c.flight_recorder_size));
  ULY_RETURN_IF_ERROR(Read(root, "log_level", "", &c.log_level));
  ULY_RETURN_IF_ERROR(Read(root, "backend", "", &c.backend));
  ULY_RETURN_IF_ERROR(Read(root, "ready_file", "", &c.ready_file));
  if (root.contains("timeouts")) {
    const json& t = root["timeouts"];
    ULY_RETURN_IF_ERROR(CheckKeys(t, "timeouts",
                                  {"call_ms", "peer_ms", "drain_ms", "bind_ms", "worker_stall_ms"}));
    ULY_RETURN_IF_ERROR(Read(t, "bind_ms", "timeouts", &c.bind_timeout_ms));
    ULY_RETURN_IF_ERROR(Read(t, "worker_stall_ms", "timeouts", &c.worker_stall_ms));
    ULY_RETURN_IF_ERROR(Read(t, "drain_ms", "timeouts", &c.drain_timeout_ms));
    ULY_RETURN_IF_ERROR(Read(t, "call_ms", "timeouts", &c.call_timeout_ms));
    ULY_RETURN_IF_ERROR(Read(t, "peer_ms", "timeouts", &c.peer_timeout_ms));
  }
  if (root.contains("slots")) {
    const json& s = root["slots"];
    ULY_RETURN_IF_ERROR(CheckKeys(s, "slots", {"memory_budget_bytes", "uid_share_percent"}));
    ULY_RETURN_IF_ERROR(Read(s, "memory_budget_bytes", "slots", &c.slot_memory_budget_bytes));
    ULY_RETURN_IF_ERROR(Read(s, "uid_share_percent", "slots", &c.slot_uid_share_percent));
  }
  if (root.contains("limits")) {
    const json& l = root["limits"];
    std::set<std::string> keys;
    for (const LimitField& f : kLimitFields) keys.emplace(f.key);
    ULY_RETURN_IF_ERROR(CheckKeys(l, "limits", keys));
    for (const LimitField& f : kLimitFields) {
      const std::string key(f.key);
      ULY_RETURN_IF_ERROR(f.count != nullptr ? Read(l, key, "limits", &(c.limits.*f.count))
                                             : Read(l, key, "limits", &(c.limits.*f.bytes)));
    }
  }
  if (root.contains("rings")) {
    const json& r = root["rings"];
    ULY_RETURN_IF_ERROR(CheckKeys(r, "rings", {"worker_spin_us"}));
    ULY_RETURN_IF_ERROR(Read(r, "worker_spin_us", "rings", &c.ring_spin_us));
  }
  if (root.contains("queues")) {
    const json& q = root["queues"];
    ULY_RETURN_IF_ERROR(CheckKeys(q, "queues", {"probe_streams", "sharing"}));
    ULY_RETURN_IF_ERROR(Read(q, "probe_streams", "queues", &c.queue_probe_streams));
    ULY_RETURN_IF_ERROR(Read(q, "sharing", "queues", &c.queue_sharing));
  }
  if (root.contains("fused")) {
    const json& f = root["fused"];
    ULY_RETURN_IF_ERROR(CheckKeys(f, "fused", {"projection"}));
    ULY_RETURN_IF_ERROR(Read(f, "projection", "fused", &c.fused_projection));
  }
  if (root.contains("admin")) {
    const json& a = root["admin"];
    ULY_RETURN_IF_ERROR(CheckKeys(a, "admin", {"operator_group"}));
    ULY_RETURN_IF_ERROR(Read(a, "operator_group", "admin", &c.operator_group));
  }
  if (root.contains("metrics")) {
    const json& m = root["metrics"];
    ULY_RETURN_IF_ERROR(CheckKeys(m, "metrics", {"address"}));
    ULY_RETURN_IF_ERROR(Read(m, "address", "metrics", &c.metrics_address));
  }
  if (root.contains("devices")) {
    const json& devs = root["devices"];
    if (!devs.is_array()) return absl::InvalidArgumentError("devices: expected an array");
    for (size_t i = 0; i < devs.size(); ++i) {
      const std::string where = StrCat("devices[", i, "]");
      ULY_RETURN_IF_ERROR(CheckKeys(devs[i], where, {"index", "socket"}));
      if (!devs[i].contains("index"))
        return absl::InvalidArgumentError(StrCat(where, ".index: required"));
      DeviceEntry e;
      ULY_RETURN_IF_ERROR(Read(devs[i], "index", where, &e.index));
      e.socket = DefaultSocketPath(e.index);
      ULY_RETURN_IF_ERROR(Read(devs[i], "socket", where, &e.socket));
      c.devices.push_back(std::move(e));
    }
  }
  for (const DeviceEntry& e : c.devices) {
    if (e.index == device) c.socket = e.socket;
  }
  if (c.socket.empty()) c.socket = DefaultSocketPath(device);
  ULY_RETURN_IF_ERROR(ValidateDaemonConfig(c));
  return c;
}

absl::StatusOr<DaemonConfig> LoadDaemonConfig(const std::string& path, int32_t device) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(StrCat("config: cannot read ", path));
  std::stringstream text;
  text << in.rdbuf();
  absl::StatusOr<DaemonConfig> c = ParseDaemonConfig(text.str(), device);
  if (!c.ok()) return absl::Status(c.status().code(), StrCat(path, ": ", c.status().message()));
  return c;
}

namespace {

struct KeyFlag {
  std::string_view key, flag;
};
constexpr KeyFlag kKeyFlags[] = {
    {"device", "--device"},
    {"socket", "--socket"},
    {"backend", "--backend"},
    {"log_level", "--log-level"},
    {"ready_file", "--ready-file"},
    {"timeouts.call_ms", "--call-timeout-ms"},
    {"timeouts.peer_ms", "--peer-timeout-ms"},
    {"timeouts.drain_ms", "--drain-timeout-ms"},
    {"metrics.address", "--metrics-address"},
    {"rings.worker_spin_us", "--ring-spin-us"},
    {"admin.operator_group", "--operator-group"},
    {"queues.probe_streams", "--queue-probe-streams"},
    {"queues.sharing", "--queue-sharing"},
    {"fused.projection", "--fused-projection"},
};

absl::Status Invalid(std::string_view key, std::string_view rule) {
  const std::string_view flag = FlagOfKey(key);
  if (flag.empty()) return absl::InvalidArgumentError(StrCat(key, ": ", rule));
  return absl::InvalidArgumentError(StrCat(key, " (", flag, "): ", rule));
}

std::string JoinNames(std::span<const std::string_view> names) {
  std::string out;
  for (std::string_view n : names) out += StrCat(out.empty() ? "" : ", ", n);
  return out;
}

absl::Status CheckSocketPath(std::string_view key, const std::string& path) {
  if (path.empty() || path.size() > 100)
    return Invalid(key, StrCat("path must be 1..100 characters, got ", path.size()));
  return absl::OkStatus();
}

}  // namespace

std::string_view FlagOfKey(std::string_view key) {
  for (const KeyFlag& kf : kKeyFlags)
    if (kf.key == key) return kf.flag;
  return {};
}

std::string HostPort::ToString() const { return WithPort(port); }

std::string HostPort::WithPort(int bound_port) const {
  if (host.find(':') != std::string::npos) return StrCat("[", host, "]:", bound_port);
  return StrCat(host, ":", bound_port);
}

absl::StatusOr<HostPort> ParseHostPort(std::string_view text) {
  // The same rules as the metrics.address pattern of deploy/config.schema.json.
  const std::string quoted = StrCat("'", text, "'");
  const size_t colon = text.rfind(':');
  if (colon == std::string_view::npos)
    return absl::InvalidArgumentError(StrCat(quoted, " is not HOST:PORT (no port)"));
  std::string_view host = text.substr(0, colon);
  const std::string_view port_text = text.substr(colon + 1);
  HostPort out;
  if (!host.empty() && host.front() == '[') {
    const bool closed = host.size() >= 3 && host.back() == ']';
    const std::string_view inner = closed ? host.substr(1, host.size() - 2) : std::string_view();
    const bool hex = closed && inner.find(':') != std::string_view::npos &&
                     inner.find_first_not_of("0123456789abcdefABCDEF:.") == std::string_view::npos;
    if (!hex)
      return absl::InvalidArgumentError(
          StrCat(quoted, ": an IPv6 host is hex digits, ':' and '.' inside brackets"));
    out.host = std::string(inner);
  } else {
    if (host.empty())
      return absl::InvalidArgumentError(StrCat(quoted, " is not HOST:PORT (empty host)"));
    if (host.find(':') != std::string_view::npos)
      return absl::InvalidArgumentError(
          StrCat(quoted, ": an IPv6 host needs brackets, as in [::1]:9500"));
    if (host.find_first_of("[] \t\n\r\f\v") != std::string_view::npos)
      return absl::InvalidArgumentError(
          StrCat(quoted, ": the host has a bracket or blank in it"));
    out.host = std::string(host);
  }
  const bool digits = !port_text.empty() && port_text.size() <= 5 &&
                      port_text.find_first_not_of("0123456789") == std::string_view::npos &&
                      (port_text.size() == 1 || port_text.front() != '0');
  int port = -1;
  if (digits) port = std::stoi(std::string(port_text));  // at most 5 digits: cannot throw
  if (port < 0 || port > 65535)
    return absl::InvalidArgumentError(
        StrCat(quoted, ": port '", port_text, "' is not a number in 0..65535"));
  out.port = port;
  return out;
}

absl::Status ValidateDaemonConfig(const DaemonConfig& c) {
  const auto known = std::find(kBackendNames.begin(), kBackendNames.end(), c.backend);
  if (known == kBackendNames.end())
    return Invalid("backend", StrCat("'", c.backend, "' is not one of ", JoinNames(kBackendNames)));
  if (std::find(kRunnableBackends.begin(), kRunnableBackends.end(), c.backend) ==
      kRunnableBackends.end())
    return Invalid("backend", StrCat("'", c.backend, "' is not available in this build; use ",
                                     JoinNames(kRunnableBackends)));
  if (c.device < 0) return Invalid("device", StrCat("must be >= 0, got ", c.device));
  if (c.call_timeout_ms <= 0)
    return Invalid("timeouts.call_ms", StrCat("must be > 0, got ", c.call_timeout_ms));
  if (c.peer_timeout_ms <= 0)
    return Invalid("timeouts.peer_ms", StrCat("must be > 0, got ", c.peer_timeout_ms));
  if (c.drain_timeout_ms < 0)
    return Invalid("timeouts.drain_ms", StrCat("must be >= 0, got ", c.drain_timeout_ms));
  for (const LimitField& f : kLimitFields) {
    const int64_t value =
        f.count != nullptr ? c.limits.*f.count : static_cast<int64_t>(c.limits.*f.bytes > 0);
    if (value < 1) return Invalid(StrCat("limits.", f.key), StrCat("must be >= 1, got ", value));
  }
  if (c.slot_uid_share_percent < 1 || c.slot_uid_share_percent > 100)
    return Invalid("slots.uid_share_percent",
                   StrCat("must be in [1, 100], got ", c.slot_uid_share_percent));
  if (c.bind_timeout_ms <= 0 || c.bind_timeout_ms > 3600 * 1000)
    return Invalid("timeouts.bind_ms", StrCat("must be in [1, 3600000], got ", c.bind_timeout_ms));
  if (c.worker_stall_ms < 0 || c.worker_stall_ms > 3600 * 1000)
    return Invalid("timeouts.worker_stall_ms",
                   StrCat("must be in [0, 3600000], got ", c.worker_stall_ms));
  if (c.ring_spin_us < 0 || c.ring_spin_us > kMaxRingSpinUs)
    return Invalid("rings.worker_spin_us",
                   StrCat("must be in [0, ", kMaxRingSpinUs, "], got ", c.ring_spin_us));
  if (c.queue_probe_streams < 0 || c.queue_probe_streams > kMaxQueueProbeStreams)
    return Invalid("queues.probe_streams", StrCat("must be in [0, ", kMaxQueueProbeStreams,
                                                  "], got ", c.queue_probe_streams));
  if (c.queue_sharing != "allow" && c.queue_sharing != "refuse")
    return Invalid("queues.sharing",
                   StrCat("'", c.queue_sharing, "' is not one of allow, refuse"));
  if (c.fused_projection != "cublaslt" && c.fused_projection != "cutlass")
    return Invalid("fused.projection",
                   StrCat("'", c.fused_projection, "' is not one of cublaslt, cutlass"));
  if (c.flight_recorder_size < 1 || c.flight_recorder_size > 1000000)
    return Invalid("flight_recorder_size",
                   StrCat("must be in [1, 1000000], got ", c.flight_recorder_size));
  if (!c.metrics_address.empty()) {
    absl::StatusOr<HostPort> hp = ParseHostPort(c.metrics_address);
    if (!hp.ok()) return Invalid("metrics.address", StdView(hp.status().message()));
  }
  if (!c.operator_group.empty()) {
    absl::StatusOr<uint32_t> gid = ResolveGroup(c.operator_group);
    if (!gid.ok()) return Invalid("admin.operator_group", StdView(gid.status().message()));
  }
  std::set<int32_t> seen;
  for (size_t i = 0; i < c.devices.size(); ++i) {
    const DeviceEntry& e = c.devices[i];
    const std::string where = StrCat("devices[", i, "]");
    if (e.index < 0) return Invalid(StrCat(where, ".index"), StrCat("must be >= 0, got ", e.index));
    if (!seen.insert(e.index).second)
      return Invalid(StrCat(where, ".index"), StrCat(e.index, " is listed twice"));
    ULY_RETURN_IF_ERROR(CheckSocketPath(StrCat(where, ".socket"), e.socket));
  }
  ULY_RETURN_IF_ERROR(CheckSocketPath("socket", c.socket));
  // The level is checked by the logging setup, which knows the names.
  spdlog::level::level_enum lvl = spdlog::level::from_str(c.log_level);
  if (lvl == spdlog::level::off && c.log_level != "off")
    return Invalid("log_level", StrCat("'", c.log_level, "' is unknown"));
  return absl::OkStatus();
}

}  // namespace ulysses
