#include "ulysses/common/config.h"

#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include "ulysses/common/strings.h"
#include "absl/strings/numbers.h"
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

std::string DefaultSocketPath(int32_t index) {
  return StrCat("/run/ulysses/gpu", index, ".sock");
}

absl::StatusOr<DaemonConfig> ParseDaemonConfig(const std::string& json_text, int32_t device) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::parse_error& e) {
    return absl::InvalidArgumentError(StrCat("config: not valid JSON: ", e.what()));
  }
  ULY_RETURN_IF_ERROR(CheckKeys(root, "", {"log_level", "backend", "timeouts", "slots",
                                           "metrics", "ready_file", "devices",
                                           "flight_recorder_size"}));
  DaemonConfig c;
  c.device = device;
  ULY_RETURN_IF_ERROR(Read(root, "flight_recorder_size", "", &c.flight_recorder_size));
  ULY_RETURN_IF_ERROR(Read(root, "log_level", "", &c.log_level));
  ULY_RETURN_IF_ERROR(Read(root, "backend", "", &c.backend));
  ULY_RETURN_IF_ERROR(Read(root, "ready_file", "", &c.ready_file));
  if (root.contains("timeouts")) {
    const json& t = root["timeouts"];
    ULY_RETURN_IF_ERROR(CheckKeys(t, "timeouts", {"call_ms", "peer_ms", "drain_ms"}));
    ULY_RETURN_IF_ERROR(Read(t, "drain_ms", "timeouts", &c.drain_timeout_ms));
    ULY_RETURN_IF_ERROR(Read(t, "call_ms", "timeouts", &c.call_timeout_ms));
    ULY_RETURN_IF_ERROR(Read(t, "peer_ms", "timeouts", &c.peer_timeout_ms));
  }
  if (root.contains("slots")) {
    const json& s = root["slots"];
    ULY_RETURN_IF_ERROR(CheckKeys(s, "slots", {"memory_budget_bytes"}));
    ULY_RETURN_IF_ERROR(Read(s, "memory_budget_bytes", "slots", &c.slot_memory_budget_bytes));
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

absl::Status ValidateDaemonConfig(const DaemonConfig& c) {
  static const std::set<std::string> kBackends = {"auto", "host", "nccl", "nvlink"};
  if (!kBackends.count(c.backend))
    return absl::InvalidArgumentError(
        StrCat("backend: '", c.backend, "' is not one of auto, host, nccl, nvlink"));
  if (c.device < 0) return absl::InvalidArgumentError("device: must be >= 0");
  if (c.call_timeout_ms <= 0)
    return absl::InvalidArgumentError("timeouts.call_ms: must be > 0");
  if (c.peer_timeout_ms <= 0)
    return absl::InvalidArgumentError("timeouts.peer_ms: must be > 0");
  if (c.drain_timeout_ms < 0)
    return absl::InvalidArgumentError("timeouts.drain_ms: must be >= 0");
  if (c.flight_recorder_size < 1 || c.flight_recorder_size > 1000000)
    return absl::InvalidArgumentError("flight_recorder_size: must be in [1, 1000000]");
  if (!c.metrics_address.empty()) {
    const size_t colon = c.metrics_address.rfind(':');
    int port = 0;
    if (colon == std::string::npos || colon == 0 ||
        !absl::SimpleAtoi(AbslView(std::string_view(c.metrics_address).substr(colon + 1)), &port) ||
        port < 0 || port > 65535)
      return absl::InvalidArgumentError(StrCat("metrics.address: '", c.metrics_address,
                                               "' is not host:port"));
  }
  if (c.socket.empty() || c.socket.size() > 100)
    return absl::InvalidArgumentError(
        StrCat("socket: path must be 1..100 characters, got ", c.socket.size()));
  std::set<int32_t> seen;
  for (const DeviceEntry& e : c.devices) {
    if (!seen.insert(e.index).second)
      return absl::InvalidArgumentError(StrCat("devices: index ", e.index, " is listed twice"));
  }
  // The level is checked by the logging setup, which knows the names.
  spdlog::level::level_enum lvl = spdlog::level::from_str(c.log_level);
  if (lvl == spdlog::level::off && c.log_level != "off")
    return absl::InvalidArgumentError(StrCat("log_level: '", c.log_level, "' is unknown"));
  return absl::OkStatus();
}

}  // namespace ulysses
