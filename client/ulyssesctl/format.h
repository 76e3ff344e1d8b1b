// Output of ulyssesctl: aligned text tables, human units, and JSON documents of the Admin
// messages. Pure functions of their arguments (the current time is passed in), so they are
// tested without a daemon.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "google/protobuf/message.h"
#include "nlohmann/json.hpp"
#include "ulysses/v1/admin.pb.h"

namespace ulysses::ctl {

/// Horizontal placement of a column's cells (headers follow the cells).
enum class Align { kLeft, kRight };

/// One column of a Table.
struct Column {
  std::string header;
  Align align = Align::kLeft;
};

/// A text table: a header row, then one line per row; every column is as wide as its widest
/// cell and columns are separated by two spaces. No line has trailing blanks. Cells are single
/// line: tabs and newlines become spaces, and an empty cell prints as "-" so that every row
/// has the same number of whitespace-separated words when no cell has blanks. Not
/// thread-safe.
class Table {
 public:
  explicit Table(std::vector<Column> columns);

  /// Appends a row. Missing trailing cells print as "-"; extra cells are dropped.
  void AddRow(std::vector<std::string> cells);
  /// The header line and every row, each ending in '\n'.
  std::string Render() const;

  std::size_t num_rows() const { return rows_.size(); }

 private:
  std::vector<Column> columns_;
  std::vector<std::vector<std::string>> rows_;
};

/// "key:  value" lines with the values aligned, each ending in '\n'.
std::string RenderKeyValues(const std::vector<std::pair<std::string, std::string>>& rows);

/// Binary units with one decimal: "512 B", "1.0 KiB", "12.5 MiB", "3.0 GiB" (up to PiB).
std::string FormatBytes(std::uint64_t bytes);
/// A duration for humans: "850ms", "3.2s", "5m12s", "3h05m", "2d03h". Negative values (clock
/// skew) print as "0ms".
std::string FormatDuration(double seconds);
/// FormatDuration of a count of milliseconds.
std::string FormatAgeMs(std::int64_t ms);
/// A duration in microseconds: "0us" to "999us" below a millisecond, else FormatDuration.
/// Negative values (clock skew) print as "0us".
std::string FormatDurationUs(std::int64_t us);
/// A Unix time in microseconds as local ISO 8601 time with milliseconds (truncated):
/// "2023-11-14T23:13:20.123". 0 (not set) prints as "-".
std::string FormatLocalTimeUs(std::int64_t unix_us);
/// Short lower-case name of a dtype: "float16", "bfloat16", "float32"; "-" when unspecified.
std::string DTypeName(int dtype);

/// JSON object of any message: every field of the message's descriptor (default values
/// included), keys are the proto field names (snake_case), 64-bit integers stay numbers,
/// enums are their value names, repeated fields are arrays, message fields nested objects.
nlohmann::json MessageToJson(const google::protobuf::Message& message);

/// The JSON documents printed by `ulyssesctl --json COMMAND`.
nlohmann::json StateToJson(const v1::DaemonState& state);
nlohmann::json ClientsToJson(const v1::ListClientsResponse& response);    // {"clients":[...]}
nlohmann::json GroupsToJson(const v1::ListGroupsResponse& response);      // {"groups":[...]}
nlohmann::json SessionsToJson(const v1::ListSessionsResponse& response);  // {"sessions":[...]}
nlohmann::json SlotsToJson(const v1::ListSlotsResponse& response);        // {"slots":[...]}
nlohmann::json RecentCallsToJson(const v1::ListRecentCallsResponse& response);  // {"calls":[...],
                                                                                 // "capacity":N}
nlohmann::json DrainToJson(const v1::DrainResponse& response);
nlohmann::json UndrainToJson(const v1::UndrainResponse& response);  // {}
/// {"status": "SERVING"} for the health command.
nlohmann::json HealthToJson(std::string_view status);
/// The DrainResponse that a state reports (what `drain --wait` prints once it has waited).
v1::DrainResponse DrainFromState(const v1::DaemonState& state);

/// The text printed by `ulyssesctl COMMAND`. `now_unix_ms` is the current Unix time in
/// milliseconds, from which the clients' ages are computed.
std::string RenderState(const v1::DaemonState& state);
std::string RenderClients(const v1::ListClientsResponse& response, std::int64_t now_unix_ms);
std::string RenderGroups(const v1::ListGroupsResponse& response);
std::string RenderSessions(const v1::ListSessionsResponse& response);
std::string RenderSlots(const v1::ListSlotsResponse& response);
/// Times print as local time (FormatLocalTimeUs), durations as done - queued.
std::string RenderRecentCalls(const v1::ListRecentCallsResponse& response);
/// "draining; idle" or "draining; N call(s) running, M session(s) open" (one line).
std::string RenderDrain(const v1::DrainResponse& response);
/// "serving" (one line).
std::string RenderUndrain(const v1::UndrainResponse& response);

}  // namespace ulysses::ctl
