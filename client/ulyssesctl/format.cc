#include "ulyssesctl/format.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <ctime>

#include "google/protobuf/descriptor.h"
#include "ulysses/common/strings.h"
#include "ulysses/v1/types.pb.h"

namespace ulysses::ctl {
namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::Reflection;
using nlohmann::json;

std::string SanitizeCell(std::string cell) {
  for (char& c : cell) {
    if (c == '\t' || c == '\n' || c == '\r') c = ' ';
  }
  const auto first = cell.find_first_not_of(' ');
  if (first == std::string::npos) return "-";
  const auto last = cell.find_last_not_of(' ');
  return cell.substr(first, last - first + 1);
}

// Terminal columns of a UTF-8 string, counting each code point as one column.
std::size_t DisplayWidth(std::string_view s) {
  return static_cast<std::size_t>(std::count_if(
      s.begin(), s.end(), [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; }));
}

std::string Printf(const char* format, double value, const char* unit) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, value, unit);
  return buf;
}

// "DTYPE_BFLOAT16" -> "bfloat16": the value name less the prefix its enum's *_UNSPECIFIED
// value has ("DTYPE_"), in lower case.
std::string EnumValueName(const google::protobuf::EnumValueDescriptor& value) {
  std::string name = value.name();
  const auto* zero = value.type()->FindValueByNumber(0);
  constexpr std::string_view kUnspecified = "UNSPECIFIED";
  if (zero != nullptr && zero->name().size() > kUnspecified.size() &&
      zero->name().compare(zero->name().size() - kUnspecified.size(), kUnspecified.size(),
                           kUnspecified) == 0) {
    const std::string prefix = zero->name().substr(0, zero->name().size() - kUnspecified.size());
    if (name.rfind(prefix, 0) == 0) name.erase(0, prefix.size());
  }
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return name;
}

bool EndsWith(std::string_view s, std::string_view suffix) {
  return s.size() > suffix.size() && s.substr(s.size() - suffix.size()) == suffix;
}

// The JSON key and value of a scalar field under the naming scheme of MessageToJson.
std::pair<std::string, json> Normalized(const FieldDescriptor& f, json value) {
  const std::string& name = f.name();
  const bool integer = value.is_number_integer();
  auto base = [&](std::string_view suffix) { return name.substr(0, name.size() - suffix.size()); };
  if (integer && EndsWith(name, "_unix_ms")) {
    const std::int64_t ms = value.get<std::int64_t>();
    return {base("_unix_ms") + "_time", ms == 0 ? json() : json(FormatUtcTimeUs(ms * 1000))};
  }
  if (integer && EndsWith(name, "_unix_us")) {
    const std::int64_t us = value.get<std::int64_t>();
    return {base("_unix_us") + "_time", us == 0 ? json() : json(FormatUtcTimeUs(us))};
  }
  if (value.is_number() && EndsWith(name, "_ms"))
    return {base("_ms") + "_seconds", value.get<double>() / 1e3};
  if (value.is_number() && EndsWith(name, "_us"))
    return {base("_us") + "_seconds", value.get<double>() / 1e6};
  if (value.is_number() && EndsWith(name, "_s"))
    return {base("_s") + "_seconds", value.get<double>()};
  return {name, std::move(value)};
}

// index < 0: the singular field; otherwise element `index` of the repeated field.
json FieldToJson(const Message& m, const Reflection& r, const FieldDescriptor& f, int index) {
  const bool rep = index >= 0;
  switch (f.cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
      return rep ? r.GetRepeatedInt32(m, &f, index) : r.GetInt32(m, &f);
    case FieldDescriptor::CPPTYPE_INT64:
      return rep ? r.GetRepeatedInt64(m, &f, index) : r.GetInt64(m, &f);
    case FieldDescriptor::CPPTYPE_UINT32:
      return rep ? r.GetRepeatedUInt32(m, &f, index) : r.GetUInt32(m, &f);
    case FieldDescriptor::CPPTYPE_UINT64:
      return rep ? r.GetRepeatedUInt64(m, &f, index) : r.GetUInt64(m, &f);
    case FieldDescriptor::CPPTYPE_DOUBLE:
      return rep ? r.GetRepeatedDouble(m, &f, index) : r.GetDouble(m, &f);
    case FieldDescriptor::CPPTYPE_FLOAT:
      return rep ? r.GetRepeatedFloat(m, &f, index) : r.GetFloat(m, &f);
    case FieldDescriptor::CPPTYPE_BOOL:
      return rep ? r.GetRepeatedBool(m, &f, index) : r.GetBool(m, &f);
    case FieldDescriptor::CPPTYPE_STRING:
      return rep ? r.GetRepeatedString(m, &f, index) : r.GetString(m, &f);
    case FieldDescriptor::CPPTYPE_ENUM: {
      // Open enums may carry a number this build does not know: print the number then.
      const int number = rep ? r.GetRepeatedEnumValue(m, &f, index) : r.GetEnumValue(m, &f);
      const auto* value = f.enum_type()->FindValueByNumber(number);
      if (value == nullptr) return number;
      return EnumValueName(*value);
    }
    case FieldDescriptor::CPPTYPE_MESSAGE:
      return MessageToJson(rep ? r.GetRepeatedMessage(m, &f, index) : r.GetMessage(m, &f));
  }
  return nullptr;
}

std::string Str(std::uint64_t v) { return StrCat(v); }
std::string Str(std::int64_t v) { return StrCat(v); }
std::string Str(int v) { return StrCat(v); }

std::string JoinIds(const google::protobuf::RepeatedField<std::uint64_t>& ids) {
  std::string out;
  for (const auto id : ids) {
    if (!out.empty()) out += ',';
    out += Str(id);
  }
  return out;
}

// 0 marks "no client" in the Admin messages.
std::string ClientOrDash(std::uint64_t id) { return id == 0 ? "-" : Str(id); }

}  // namespace

Table::Table(std::vector<Column> columns) : columns_(std::move(columns)) {}

void Table::AddRow(std::vector<std::string> cells) {
  cells.resize(columns_.size());
  for (auto& c : cells) c = SanitizeCell(std::move(c));
  rows_.push_back(std::move(cells));
}

std::string Table::Render(bool headers) const {
  std::vector<std::size_t> widths(columns_.size());
  for (std::size_t i = 0; i < columns_.size(); ++i) {
    widths[i] = DisplayWidth(columns_[i].header);
    for (const auto& row : rows_) widths[i] = std::max(widths[i], DisplayWidth(row[i]));
  }
  std::string out;
  auto emit = [&](auto cell_of) {
    std::string line;
    for (std::size_t i = 0; i < columns_.size(); ++i) {
      const std::string& cell = cell_of(i);
      const std::string pad(widths[i] - DisplayWidth(cell), ' ');
      if (i > 0) line += "  ";
      line += columns_[i].align == Align::kRight ? pad + cell : cell + pad;
    }
    line.erase(line.find_last_not_of(' ') + 1);
    out += line;
    out += '\n';
  };
  if (headers) emit([&](std::size_t i) -> const std::string& { return columns_[i].header; });
  for (const auto& row : rows_) emit([&](std::size_t i) -> const std::string& { return row[i]; });
  return out;
}

std::string RenderKeyValues(const std::vector<std::pair<std::string, std::string>>& rows) {
  std::size_t width = 0;
  for (const auto& [key, value] : rows) width = std::max(width, DisplayWidth(key) + 1);
  std::string out;
  for (const auto& [key, value] : rows) {
    out += key;
    out += ':';
    out += std::string(width - DisplayWidth(key) - 1 + 2, ' ');
    out += SanitizeCell(value);
    out += '\n';
  }
  return out;
}

std::string FormatBytes(std::uint64_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  constexpr int kLastUnit = 5;
  if (bytes < 1024) return StrCat(bytes, " B");
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < kLastUnit) {
    value /= 1024.0;
    ++unit;
  }
  // 1023.96 KiB would print as "1024.0 KiB".
  if (std::round(value * 10.0) >= 10240.0 && unit < kLastUnit) {
    value /= 1024.0;
    ++unit;
  }
  return Printf("%.1f %s", value, kUnits[unit]);
}

std::string FormatDuration(double seconds) {
  if (!(seconds > 0.0)) return "0ms";
  if (seconds < 0.9995) return StrCat(std::llround(seconds * 1000.0), "ms");
  if (seconds < 59.95) return Printf("%.1f%s", seconds, "s");
  const long long total = std::llround(seconds);
  char buf[64];
  if (total < 3600) {
    std::snprintf(buf, sizeof(buf), "%lldm%02llds", total / 60, total % 60);
  } else if (total < 86400) {
    std::snprintf(buf, sizeof(buf), "%lldh%02lldm", total / 3600, total % 3600 / 60);
  } else {
    std::snprintf(buf, sizeof(buf), "%lldd%02lldh", total / 86400, total % 86400 / 3600);
  }
  return buf;
}

std::string FormatAgeMs(std::int64_t ms) { return FormatDuration(static_cast<double>(ms) / 1000.0); }

std::string FormatDurationUs(std::int64_t us) {
  if (us < 1000) return StrCat(std::max<std::int64_t>(us, 0), "us");
  return FormatDuration(static_cast<double>(us) / 1e6);
}

namespace {

// Splits a Unix time in microseconds into seconds and the 0..999999 microseconds after them
// (floor division, so that times before 1970 keep a non-negative fraction).
std::pair<std::time_t, int> SplitUs(std::int64_t unix_us) {
  std::int64_t secs = unix_us / 1'000'000;
  std::int64_t frac = unix_us % 1'000'000;
  if (frac < 0) {
    frac += 1'000'000;
    --secs;
  }
  return {static_cast<std::time_t>(secs), static_cast<int>(frac)};
}

}  // namespace

std::string FormatLocalTimeUs(std::int64_t unix_us) {
  if (unix_us == 0) return "-";
  const auto [t, us] = SplitUs(unix_us);
  ::tzset();  // localtime_r need not read $TZ itself
  std::tm tm{};
  if (::localtime_r(&t, &tm) == nullptr) return StrCat(unix_us, "us");
  char date[64];
  if (std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%S", &tm) == 0) return StrCat(unix_us, "us");
  const long offset = tm.tm_gmtoff;  // seconds east of UTC
  char zone[32] = "Z";
  if (offset != 0) {
    const int a = static_cast<int>((offset < 0 ? -offset : offset) % 86400);
    std::snprintf(zone, sizeof(zone), "%c%02d:%02d", offset < 0 ? '-' : '+', a / 3600,
                  a % 3600 / 60);
  }
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%s.%03d%s", date, us / 1000, zone);
  return buf;
}

std::string FormatUtcTimeUs(std::int64_t unix_us) {
  if (unix_us == 0) return "";
  const auto [t, us] = SplitUs(unix_us);
  std::tm tm{};
  if (::gmtime_r(&t, &tm) == nullptr) return StrCat(unix_us, "us");
  char date[64];
  if (std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%S", &tm) == 0) return StrCat(unix_us, "us");
  char buf[96];
  std::snprintf(buf, sizeof(buf), "%s.%06dZ", date, us);
  return buf;
}

std::string DTypeName(int dtype) {
  if (dtype == v1::DTYPE_UNSPECIFIED) return "-";
  const auto* value = v1::DType_descriptor()->FindValueByNumber(dtype);
  if (value == nullptr) return StrCat("dtype(", dtype, ")");
  return EnumValueName(*value);
}

json MessageToJson(const Message& message) {
  const auto* descriptor = message.GetDescriptor();
  const auto* reflection = message.GetReflection();
  json out = json::object();
  for (int i = 0; i < descriptor->field_count(); ++i) {
    const FieldDescriptor& f = *descriptor->field(i);
    if (f.is_repeated()) {
      json array = json::array();
      const int n = reflection->FieldSize(message, &f);
      for (int j = 0; j < n; ++j) array.push_back(FieldToJson(message, *reflection, f, j));
      out[f.name()] = std::move(array);
    } else {
      // An optional scalar that is not set is unknown: null, under its normalized key.
      const bool unset = f.has_presence() && f.message_type() == nullptr &&
                         !reflection->HasField(message, &f);
      auto [key, value] = Normalized(f, FieldToJson(message, *reflection, f, -1));
      out[key] = unset ? json() : std::move(value);
    }
  }
  return out;
}

json StateToJson(const v1::DaemonState& state) { return MessageToJson(state); }
// A listing as one document: every page is read, so the paging token says nothing.
json ListingToJson(const Message& listing) {
  json out = MessageToJson(listing);
  out.erase("next_page_token");
  return out;
}

json ClientsToJson(const v1::ListClientsResponse& response) { return ListingToJson(response); }
json GroupsToJson(const v1::ListGroupsResponse& response) { return ListingToJson(response); }
json SessionsToJson(const v1::ListSessionsResponse& response) { return ListingToJson(response); }
json SlotsToJson(const v1::ListSlotsResponse& response) { return ListingToJson(response); }
json RecentCallsToJson(const v1::ListRecentCallsResponse& response) {
  return MessageToJson(response);
}
json DrainToJson(const v1::DrainResponse& response) { return MessageToJson(response); }
json HealthToJson(std::string_view status) { return json{{"status", std::string(status)}}; }

v1::DrainResponse DrainFromState(const v1::DaemonState& state) {
  v1::DrainResponse r;
  r.set_draining(state.draining());
  r.set_idle(state.idle());
  r.set_active_calls(state.active_calls());
  r.set_num_sessions(state.num_sessions());
  return r;
}

std::optional<OutputFormat> ParseOutputFormat(std::string_view name) {
  if (name == "table") return OutputFormat::kTable;
  if (name == "wide") return OutputFormat::kWide;
  if (name == "json") return OutputFormat::kJson;
  if (name == "yaml") return OutputFormat::kYaml;
  if (name == "csv") return OutputFormat::kCsv;
  return std::nullopt;
}

Listing::Listing(std::vector<Field> fields) : fields_(std::move(fields)) {}

void Listing::AddRow(std::vector<Cell> cells) {
  cells.resize(fields_.size(), Cell(""));
  rows_.push_back(std::move(cells));
}

std::string Listing::Render(OutputFormat format, bool headers) const {
  if (format == OutputFormat::kCsv) {
    std::string out;
    std::vector<std::string> line;
    if (headers) {
      for (const Field& f : fields_) line.push_back(f.name);
      out += CsvLine(line);
    }
    for (const auto& row : rows_) {
      line.clear();
      for (const Cell& c : row) line.push_back(c.raw);
      out += CsvLine(line);
    }
    return out;
  }
  const bool wide = format == OutputFormat::kWide;
  std::vector<Column> columns;
  std::vector<std::size_t> shown;
  for (std::size_t i = 0; i < fields_.size(); ++i) {
    if (fields_[i].wide && !wide) continue;
    columns.push_back({fields_[i].header, fields_[i].align});
    shown.push_back(i);
  }
  Table t(std::move(columns));
  for (const auto& row : rows_) {
    std::vector<std::string> cells;
    for (std::size_t i : shown) cells.push_back(row[i].text);
    t.AddRow(std::move(cells));
  }
  return t.Render(headers);
}

std::string CsvLine(const std::vector<std::string>& fields) {
  std::string out;
  for (std::size_t i = 0; i < fields.size(); ++i) {
    if (i > 0) out += ',';
    const std::string& f = fields[i];
    if (f.find_first_of(",\"\r\n") == std::string::npos) {
      out += f;
      continue;
    }
    out += '"';
    for (char c : f) {
      if (c == '"') out += '"';
      out += c;
    }
    out += '"';
  }
  out += '\n';
  return out;
}

namespace {

bool PlainYamlKey(const std::string& key) {
  if (key.empty() || !(std::isalpha(static_cast<unsigned char>(key[0])) || key[0] == '_'))
    return false;
  return std::all_of(key.begin(), key.end(), [](unsigned char c) {
    return std::isalnum(c) || c == '_' || c == '-' || c == '.';
  });
}

std::string YamlScalar(const json& v) {
  if (v.is_string()) return v.dump(-1, ' ', false, json::error_handler_t::replace);
  if (v.is_null()) return "null";
  return v.dump();
}

void EmitYaml(const json& v, int indent, std::string& out) {
  const std::string pad(static_cast<std::size_t>(indent), ' ');
  if (v.is_object()) {
    for (const auto& [key, value] : v.items()) {
      out += pad;
      out += PlainYamlKey(key) ? key : json(key).dump(-1, ' ', false, json::error_handler_t::replace);
      out += ':';
      if ((value.is_object() || value.is_array()) && !value.empty()) {
        out += '\n';
        EmitYaml(value, value.is_array() ? indent : indent + 2, out);
      } else {
        out += ' ';
        out += value.is_object() ? "{}" : value.is_array() ? "[]" : YamlScalar(value);
        out += '\n';
      }
    }
    return;
  }
  if (v.is_array()) {
    for (const auto& item : v) {
      out += pad;
      out += '-';
      if ((item.is_object() || item.is_array()) && !item.empty()) {
        // The first line of a nested block goes on the dash's line.
        std::string nested;
        EmitYaml(item, indent + 2, nested);
        out += ' ';
        out += nested.substr(static_cast<std::size_t>(indent) + 2);
      } else {
        out += ' ';
        out += item.is_object() ? "{}" : item.is_array() ? "[]" : YamlScalar(item);
        out += '\n';
      }
    }
    return;
  }
  out += pad + YamlScalar(v) + '\n';
}

std::string Seconds(double s) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6g", s);
  return buf;
}

std::string Bool(bool b) { return b ? "true" : "false"; }

// A key-value cell: text "yes"/"no", raw true/false.
Cell YesNo(bool b) { return Cell(b ? "yes" : "no", Bool(b)); }

Cell LocalTime(std::int64_t unix_us) { return Cell(FormatLocalTimeUs(unix_us), FormatUtcTimeUs(unix_us)); }

// A value the daemon may not know: "unknown" for people, empty in CSV.
Cell Known(bool known, std::string value) {
  return known ? Cell(std::move(value)) : Cell("unknown", "");
}

Cell Bytes(std::uint64_t bytes) { return Cell(FormatBytes(bytes), Str(bytes)); }

std::string Joined(const google::protobuf::RepeatedPtrField<std::string>& items) {
  std::string out;
  for (const auto& i : items) out += (out.empty() ? "" : ",") + i;
  return out;
}

std::string JoinInts(const google::protobuf::RepeatedField<std::int32_t>& items) {
  std::string out;
  for (const auto i : items) out += StrCat(out.empty() ? "" : ",", i);
  return out;
}

std::string DrainLine(bool draining, bool idle, int active_calls, int num_sessions) {
  std::string out = draining ? "draining" : "serving";
  if (idle) {
    out += "; idle";
  } else {
    out += StrCat("; ", active_calls, " call(s) running, ", num_sessions, " session(s) open");
  }
  return out + '\n';
}

Listing DrainStateListing(bool draining, bool idle, int active_calls, int num_sessions) {
  Listing l({{"DRAINING", "draining"},
             {"IDLE", "idle"},
             {"ACTIVE_CALLS", "active_calls", Align::kRight},
             {"SESSIONS", "num_sessions", Align::kRight}});
  l.AddRow({YesNo(draining), YesNo(idle), Str(active_calls), Str(num_sessions)});
  return l;
}

}  // namespace

std::string ToYaml(const json& document) {
  std::string out;
  if ((document.is_object() || document.is_array()) && document.empty())
    return document.is_object() ? "{}\n" : "[]\n";
  EmitYaml(document, 0, out);
  return out;
}

Listing StateListing(const v1::DaemonState& s) {
  Listing l({{"VERSION", "version"},
             {"DEVICE", "device", Align::kRight},
             {"UUID", "device_uuid"},
             {"PCI_BUS_ID", "device_pci_bus_id"},
             {"NUMA_NODE", "device_numa_node", Align::kRight},
             {"PID", "pid", Align::kRight},
             {"SOCKET", "socket"},
             {"BACKEND", "backend"},
             {"MPS_MODE", "mps_mode"},
             {"HEALTH", "health"},
             {"DRAINING", "draining"},
             {"IDLE", "idle"},
             {"UPTIME", "uptime_seconds", Align::kRight},
             {"CLIENTS", "num_clients", Align::kRight},
             {"GROUPS", "num_groups", Align::kRight},
             {"SESSIONS", "num_sessions", Align::kRight},
             {"CALLS", "calls_total", Align::kRight},
             {"FAILED", "calls_failed", Align::kRight},
             {"ACTIVE_CALLS", "active_calls", Align::kRight},
             {"METRICS", "metrics_address"}});
  l.AddRow({s.version(), Str(s.device()), Known(s.has_device_uuid(), s.device_uuid()),
            Known(s.has_device_pci_bus_id(), s.device_pci_bus_id()),
            Known(s.has_device_numa_node(), Str(s.device_numa_node())),
            Str(s.pid()), s.socket(), s.backend(), s.mps_mode(), s.health(), YesNo(s.draining()),
            YesNo(s.idle()), Cell(FormatDuration(s.uptime_s()), Seconds(s.uptime_s())),
            Str(s.num_clients()), Str(s.num_groups()), Str(s.num_sessions()),
            Str(s.calls_total()), Str(s.calls_failed()), Str(s.active_calls()),
            Cell(s.metrics_address().empty() ? "off" : s.metrics_address(), s.metrics_address())});
  return l;
}

std::string RenderState(const v1::DaemonState& s) {
  std::string calls = Str(s.calls_total());
  if (s.calls_failed() > 0) calls += StrCat(" (", s.calls_failed(), " failed)");
  // GPU backends: the probed hardware queues (none: a host backend, or no probe).
  std::string queues = "-";
  if (s.hardware_queues() > 0) {
    queues = StrCat(s.hardware_queues_in_use(), " of ", s.hardware_queues(), " in use");
    if (s.queue_shared_streams() > 0)
      queues += StrCat(", ", s.queue_shared_streams(), " streams on shared queues");
    if (s.queue_refusals() > 0) queues += StrCat(", ", s.queue_refusals(), " sessions refused");
  }
  return RenderKeyValues({
      {"version", s.version()},
      {"device", Str(s.device())},
      {"gpu uuid", Known(s.has_device_uuid(), s.device_uuid()).text},
      {"pci bus id", Known(s.has_device_pci_bus_id(), s.device_pci_bus_id()).text},
      {"numa node", Known(s.has_device_numa_node(), Str(s.device_numa_node())).text},
      {"pid", Str(s.pid())},
      {"socket", s.socket()},
      {"backend", s.backend()},
      {"mps mode", s.mps_mode()},
      {"health", s.health()},
      {"draining", s.draining() ? "yes" : "no"},
      {"idle", s.idle() ? "yes" : "no"},
      {"uptime", FormatDuration(s.uptime_s())},
      {"clients", Str(s.num_clients())},
      {"groups", Str(s.num_groups())},
      {"sessions", Str(s.num_sessions())},
      {"calls", calls},
      {"active calls", Str(s.active_calls())},
      {"hw queues", queues},
      {"metrics", s.metrics_address().empty() ? "off" : s.metrics_address()},
  });
}

Listing ClientsListing(const v1::ListClientsResponse& response, std::int64_t now_unix_ms) {
  Listing l({{"ID", "client_id", Align::kRight},
             {"NAME", "name"},
             {"PID", "pid", Align::kRight},
             {"REPORTED PID", "reported_pid", Align::kRight, true},
             {"UID", "uid", Align::kRight},
             {"SINCE", "since_time", Align::kLeft, true},
             {"AGE", "age_seconds", Align::kRight},
             {"BUFFERS", "num_buffers", Align::kRight},
             {"MEMORY", "buffer_bytes", Align::kRight},
             {"SESSIONS", "num_sessions", Align::kRight},
             {"CALLS", "calls", Align::kRight}});
  for (const auto& c : response.clients()) {
    const bool known = c.since_unix_ms() > 0;
    const std::int64_t age_ms = now_unix_ms - c.since_unix_ms();
    // PID: the daemon's (credentials), else the reported one marked so; CSV keeps the raw pid.
    l.AddRow({Str(c.client_id()), c.name(), Cell(PidText(c.pid(), c.reported_pid()), Str(c.pid())),
              c.reported_pid() > 0 ? Cell(Str(c.reported_pid())) : Cell("-", "0"), Str(c.uid()),
              LocalTime(c.since_unix_ms() * 1000),
              known ? Cell(FormatAgeMs(age_ms), Seconds(static_cast<double>(age_ms) / 1e3))
                    : Cell("-", ""),
              Str(c.num_buffers()), Bytes(c.buffer_bytes()), Str(c.num_sessions()),
              Str(c.calls())});
  }
  return l;
}

std::string RenderClients(const v1::ListClientsResponse& response, std::int64_t now_unix_ms) {
  return ClientsListing(response, now_unix_ms).Render(OutputFormat::kTable, true);
}

Listing GroupsListing(const v1::ListGroupsResponse& response) {
  Listing l({{"ID", "group_id", Align::kRight},
             {"NAME", "name"},
             {"RANK", "rank", Align::kRight},
             {"WORLD", "world_size", Align::kRight},
             {"BACKEND", "backend"},
             {"CLIENTS", "client_ids"},
             {"REASON", "backend_reason"},
             {"MEMBERS", "members", Align::kLeft, true}});
  for (const auto& g : response.groups()) {
    const auto& i = g.info();
    l.AddRow({Str(i.group_id()), i.name(), Str(i.rank()), Str(i.world_size()), i.backend(),
              JoinIds(g.client_ids()), i.backend_reason(), Joined(i.members())});
  }
  return l;
}

std::string RenderGroups(const v1::ListGroupsResponse& response) {
  return GroupsListing(response).Render(OutputFormat::kTable, true);
}

Listing SessionsListing(const v1::ListSessionsResponse& response) {
  Listing l({{"ID", "session_id", Align::kRight},
             {"GROUP", "group_id", Align::kRight},
             {"OWNER", "owner_client_id", Align::kRight},
             {"KIND", "kind"},
             {"RANK", "rank", Align::kRight},
             {"WORLD", "world_size", Align::kRight},
             {"HEADS", "num_heads", Align::kRight},
             {"HEAD_DIM", "head_dim", Align::kRight},
             {"DTYPE", "dtype"},
             {"MAX_TOKENS", "max_tokens", Align::kRight},
             {"SLOTS", "num_slots", Align::kRight},
             {"SLOT_SIZE", "slot_bytes", Align::kRight},
             {"SEGMENT", "segment_bytes", Align::kRight},
             {"CALLS", "calls", Align::kRight},
             {"EPOCH", "last_epoch", Align::kRight},
             {"BACKEND", "backend"},
             {"SCHEDULE", "schedule", Align::kLeft, true},
             {"REASON", "backend_reason", Align::kLeft, true}});
  for (const auto& s : response.sessions()) {
    const auto& i = s.info();
    const auto& spec = i.spec();
    l.AddRow({Str(i.session_id()), Str(i.group_id()),
              Cell(ClientOrDash(s.owner_client_id()), Str(s.owner_client_id())), s.kind(),
              Str(i.rank()), Str(i.world_size()), Str(spec.num_heads()), Str(spec.head_dim()),
              DTypeName(spec.dtype()), Str(spec.max_tokens()), Str(spec.num_slots()),
              Bytes(i.slot_bytes()), Bytes(i.segment_bytes()), Str(s.calls()),
              Str(s.last_epoch()), i.backend(), JoinInts(spec.schedule()), i.backend_reason()});
  }
  return l;
}

std::string RenderSessions(const v1::ListSessionsResponse& response) {
  return SessionsListing(response).Render(OutputFormat::kTable, true);
}

Listing SlotsListing(const v1::ListSlotsResponse& response) {
  Listing l({{"SESSION", "session_id", Align::kRight},
             {"SLOT", "slot", Align::kRight},
             {"STATE", "state"},
             {"OWNER", "owner_client_id", Align::kRight},
             {"EPOCH", "epoch", Align::kRight},
             {"AGE", "age_seconds", Align::kRight}});
  for (const auto& s : response.slots()) {
    l.AddRow({Str(s.session_id()), Str(s.slot()), s.state(),
              Cell(ClientOrDash(s.owner_client_id()), Str(s.owner_client_id())), Str(s.epoch()),
              Cell(FormatAgeMs(s.age_ms()), Seconds(static_cast<double>(s.age_ms()) / 1e3))});
  }
  return l;
}

std::string RenderSlots(const v1::ListSlotsResponse& response) {
  return SlotsListing(response).Render(OutputFormat::kTable, true);
}

Listing RecentCallsListing(const v1::ListRecentCallsResponse& response) {
  Listing l({{"CLIENT", "client_id", Align::kRight},
             {"SESSION", "session_id", Align::kRight},
             {"EPOCH", "epoch", Align::kRight},
             {"OP", "op"},
             {"B", "batch", Align::kRight},
             {"SEQ", "seq", Align::kRight},
             {"QUEUED", "queued_time"},
             {"STARTED", "started_time", Align::kLeft, true},
             {"ENQUEUED", "enqueued_time", Align::kLeft, true},
             {"DONE", "done_time", Align::kLeft, true},
             {"DURATION", "duration_seconds", Align::kRight},
             {"SENT", "sent_bytes", Align::kRight, true},
             {"STATUS", "status"},
             {"MESSAGE", "message"}});
  for (const auto& c : response.calls()) {
    const bool timed = c.queued_unix_us() != 0 && c.done_unix_us() != 0;
    const std::int64_t us = c.done_unix_us() - c.queued_unix_us();
    l.AddRow({Cell(ClientOrDash(c.client_id()), Str(c.client_id())), Str(c.session_id()),
              Str(c.epoch()), c.op(), Str(c.batch()), Str(c.seq()), LocalTime(c.queued_unix_us()),
              LocalTime(c.started_unix_us()), LocalTime(c.enqueued_unix_us()),
              LocalTime(c.done_unix_us()),
              timed ? Cell(FormatDurationUs(us), Seconds(static_cast<double>(us) / 1e6))
                    : Cell("-", ""),
              Bytes(c.sent_bytes()), c.status(), c.message()});
  }
  return l;
}

std::string RenderRecentCalls(const v1::ListRecentCallsResponse& response) {
  return RecentCallsListing(response).Render(OutputFormat::kTable, true);
}

Listing DrainListing(const v1::DrainResponse& r) {
  return DrainStateListing(r.draining(), r.idle(), r.active_calls(), r.num_sessions());
}

Listing HealthListing(std::string_view status) {
  Listing l(std::vector<Field>{{"STATUS", "status"}});
  l.AddRow({std::string(status)});
  return l;
}

std::string RenderDrain(const v1::DrainResponse& r) {
  return DrainLine(r.draining(), r.idle(), r.active_calls(), r.num_sessions());
}


}  // namespace ulysses::ctl
