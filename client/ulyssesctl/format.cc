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
      return value->name();
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

std::string Table::Render() const {
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
  emit([&](std::size_t i) -> const std::string& { return columns_[i].header; });
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

std::string FormatLocalTimeUs(std::int64_t unix_us) {
  if (unix_us == 0) return "-";
  // Floor division, so that times before 1970 keep a 0..999 millisecond part.
  std::int64_t ms = unix_us / 1000;
  if (unix_us % 1000 < 0) --ms;
  std::int64_t secs = ms / 1000;
  if (ms % 1000 < 0) --secs;
  const auto millis = static_cast<int>(ms - secs * 1000);
  const auto t = static_cast<std::time_t>(secs);
  ::tzset();  // localtime_r need not read $TZ itself
  std::tm tm{};
  if (::localtime_r(&t, &tm) == nullptr) return StrCat(unix_us, "us");
  char date[64];
  if (std::strftime(date, sizeof(date), "%Y-%m-%dT%H:%M:%S", &tm) == 0) {
    return StrCat(unix_us, "us");
  }
  char buf[80];
  std::snprintf(buf, sizeof(buf), "%s.%03d", date, millis);
  return buf;
}

std::string DTypeName(int dtype) {
  if (dtype == v1::DTYPE_UNSPECIFIED) return "-";
  if (!v1::DType_IsValid(dtype)) return StrCat("dtype(", dtype, ")");
  std::string name = v1::DType_Name(static_cast<v1::DType>(dtype));
  constexpr std::string_view kPrefix = "DTYPE_";
  if (name.rfind(kPrefix, 0) == 0) name.erase(0, kPrefix.size());
  std::transform(name.begin(), name.end(), name.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return name;
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
      out[f.name()] = FieldToJson(message, *reflection, f, -1);
    }
  }
  return out;
}

json StateToJson(const v1::DaemonState& state) { return MessageToJson(state); }
json ClientsToJson(const v1::ListClientsResponse& response) { return MessageToJson(response); }
json GroupsToJson(const v1::ListGroupsResponse& response) { return MessageToJson(response); }
json SessionsToJson(const v1::ListSessionsResponse& response) { return MessageToJson(response); }
json SlotsToJson(const v1::ListSlotsResponse& response) { return MessageToJson(response); }
json RecentCallsToJson(const v1::ListRecentCallsResponse& response) {
  return MessageToJson(response);
}
json DrainToJson(const v1::DrainResponse& response) { return MessageToJson(response); }
json UndrainToJson(const v1::UndrainResponse& response) { return MessageToJson(response); }
json HealthToJson(std::string_view status) { return json{{"status", std::string(status)}}; }

v1::DrainResponse DrainFromState(const v1::DaemonState& state) {
  v1::DrainResponse r;
  r.set_draining(state.draining());
  r.set_idle(state.idle());
  r.set_active_calls(state.active_calls());
  r.set_num_sessions(state.num_sessions());
  return r;
}

std::string RenderState(const v1::DaemonState& s) {
  std::string calls = Str(s.calls_total());
  if (s.calls_failed() > 0) calls += StrCat(" (", s.calls_failed(), " failed)");
  return RenderKeyValues({
      {"version", s.version()},
      {"device", Str(s.device())},
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
      {"metrics", s.metrics_address().empty() ? "off" : s.metrics_address()},
  });
}

std::string RenderClients(const v1::ListClientsResponse& response, std::int64_t now_unix_ms) {
  Table t({{"ID", Align::kRight},
           {"NAME"},
           {"PID", Align::kRight},
           {"UID", Align::kRight},
           {"AGE", Align::kRight},
           {"BUFFERS", Align::kRight},
           {"MEMORY", Align::kRight},
           {"SESSIONS", Align::kRight},
           {"CALLS", Align::kRight}});
  for (const auto& c : response.clients()) {
    t.AddRow({Str(c.client_id()), c.name(), Str(c.pid()), Str(c.uid()),
              c.since_unix_ms() > 0 ? FormatAgeMs(now_unix_ms - c.since_unix_ms()) : "-",
              Str(c.num_buffers()), FormatBytes(c.buffer_bytes()), Str(c.num_sessions()),
              Str(c.calls())});
  }
  return t.Render();
}

std::string RenderGroups(const v1::ListGroupsResponse& response) {
  Table t({{"ID", Align::kRight},
           {"NAME"},
           {"RANK", Align::kRight},
           {"WORLD", Align::kRight},
           {"BACKEND"},
           {"CLIENTS"},
           {"REASON"}});
  for (const auto& g : response.groups()) {
    const auto& i = g.info();
    t.AddRow({Str(i.group_id()), i.name(), Str(i.rank()), Str(i.world_size()), i.backend(),
              JoinIds(g.client_ids()), i.backend_reason()});
  }
  return t.Render();
}

std::string RenderSessions(const v1::ListSessionsResponse& response) {
  Table t({{"ID", Align::kRight},
           {"GROUP", Align::kRight},
           {"OWNER", Align::kRight},
           {"KIND"},
           {"RANK", Align::kRight},
           {"WORLD", Align::kRight},
           {"HEADS", Align::kRight},
           {"HEAD_DIM", Align::kRight},
           {"DTYPE"},
           {"MAX_TOKENS", Align::kRight},
           {"SLOTS", Align::kRight},
           {"SLOT_SIZE", Align::kRight},
           {"SEGMENT", Align::kRight},
           {"CALLS", Align::kRight},
           {"EPOCH", Align::kRight},
           {"BACKEND"}});
  for (const auto& s : response.sessions()) {
    const auto& i = s.info();
    const auto& spec = i.spec();
    t.AddRow({Str(i.session_id()), Str(i.group_id()), ClientOrDash(s.owner_client_id()), s.kind(),
              Str(i.rank()), Str(i.world_size()), Str(spec.num_heads()), Str(spec.head_dim()),
              DTypeName(spec.dtype()), Str(spec.max_tokens()), Str(spec.num_slots()),
              FormatBytes(i.slot_bytes()), FormatBytes(i.segment_bytes()), Str(s.calls()),
              Str(s.last_epoch()), i.backend()});
  }
  return t.Render();
}

std::string RenderSlots(const v1::ListSlotsResponse& response) {
  Table t({{"SESSION", Align::kRight},
           {"SLOT", Align::kRight},
           {"STATE"},
           {"OWNER", Align::kRight},
           {"EPOCH", Align::kRight},
           {"AGE", Align::kRight}});
  for (const auto& s : response.slots()) {
    t.AddRow({Str(s.session_id()), Str(s.slot()), s.state(), ClientOrDash(s.owner_client_id()),
              Str(s.epoch()), FormatAgeMs(s.age_ms())});
  }
  return t.Render();
}

std::string RenderRecentCalls(const v1::ListRecentCallsResponse& response) {
  Table t({{"CLIENT", Align::kRight},
           {"SESSION", Align::kRight},
           {"EPOCH", Align::kRight},
           {"OP"},
           {"B", Align::kRight},
           {"SEQ", Align::kRight},
           {"QUEUED"},
           {"DURATION", Align::kRight},
           {"STATUS"},
           {"MESSAGE"}});
  for (const auto& c : response.calls()) {
    const bool timed = c.queued_unix_us() != 0 && c.done_unix_us() != 0;
    t.AddRow({ClientOrDash(c.client_id()), Str(c.session_id()), Str(c.epoch()), c.op(),
              Str(c.batch()), Str(c.seq()), FormatLocalTimeUs(c.queued_unix_us()),
              timed ? FormatDurationUs(c.done_unix_us() - c.queued_unix_us()) : "-", c.status(),
              c.message()});
  }
  return t.Render();
}

std::string RenderDrain(const v1::DrainResponse& r) {
  std::string out = r.draining() ? "draining" : "serving";
  if (r.idle()) {
    out += "; idle";
  } else {
    out += StrCat("; ", r.active_calls(), " call(s) running, ", r.num_sessions(),
                  " session(s) open");
  }
  return out + '\n';
}

std::string RenderUndrain(const v1::UndrainResponse&) { return "serving\n"; }

}  // namespace ulysses::ctl
