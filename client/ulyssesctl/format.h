// Output of ulyssesctl: aligned text tables, human units, and JSON documents of the Admin
// messages. Pure functions of their arguments (the current time is passed in), so they are
// tested without a daemon.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "google/protobuf/message.h"
#include "nlohmann/json.hpp"
#include "ulysses/v1/admin.pb.h"

namespace ulysses::ctl {

/// How ulyssesctl prints an answer (`-o`): `table` for people (human units, local times),
/// `wide` (more columns), `json` and `yaml` (one document), `csv` (RFC 4180, raw numbers with
/// their unit in the column name, as nvidia-smi's `--format=csv,nounits`).
enum class OutputFormat { kTable, kWide, kJson, kYaml, kCsv };

/// Parses "table", "wide", "json", "yaml" or "csv".
std::optional<OutputFormat> ParseOutputFormat(std::string_view name);

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
  /// The header line (unless `headers` is false) and every row, each ending in '\n'.
  std::string Render(bool headers = true) const;

  std::size_t num_rows() const { return rows_.size(); }

 private:
  std::vector<Column> columns_;
  std::vector<std::vector<std::string>> rows_;
};

/// One field of a Listing: its table header (upper case), its CSV name (snake_case with the
/// unit last: `age_seconds`, `memory_bytes`, `queued_time`), and whether only `wide` shows it
/// in a table (CSV has every field).
struct Field {
  std::string header;
  std::string name;
  Align align = Align::kLeft;
  bool wide = false;
};

/// A cell: what a person reads (`text`: "12.5 MiB", "3.2s") and what CSV prints (`raw`:
/// "13107200", "3.2"). A cell made of one string uses it for both.
struct Cell {
  Cell(std::string both) : text(both), raw(std::move(both)) {}  // NOLINT: implicit on purpose
  Cell(const char* both) : Cell(std::string(both)) {}           // NOLINT
  Cell(std::string text_, std::string raw_) : text(std::move(text_)), raw(std::move(raw_)) {}
  std::string text;
  std::string raw;
};

/// The rows of one command's answer, rendered as a table (`table`: the fields that are not
/// wide-only; `wide`: all) or as CSV (every field, raw values). Not thread-safe.
class Listing {
 public:
  explicit Listing(std::vector<Field> fields);
  /// Appends a row; missing trailing cells are empty.
  void AddRow(std::vector<Cell> cells);
  /// kTable, kWide or kCsv; `headers` false leaves out the header line.
  std::string Render(OutputFormat format, bool headers) const;
  std::size_t num_rows() const { return rows_.size(); }

 private:
  std::vector<Field> fields_;
  std::vector<std::vector<Cell>> rows_;
};

/// One CSV record (RFC 4180): fields with a comma, quote, CR or LF are quoted, quotes doubled;
/// ends in '\n'.
std::string CsvLine(const std::vector<std::string>& fields);

/// YAML 1.2 of a JSON document, block style: strings double-quoted (JSON escapes are YAML's),
/// keys quoted unless plain identifiers, `{}` and `[]` for empty containers. Ends in '\n'.
std::string ToYaml(const nlohmann::json& document);

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
/// A Unix time in microseconds as local RFC 3339 time with milliseconds (truncated) and the
/// zone's offset: "2023-11-14T23:13:20.123+01:00", "...Z" in UTC. 0 (not set) prints as "-".
std::string FormatLocalTimeUs(std::int64_t unix_us);
/// A Unix time in microseconds as RFC 3339 UTC time with microseconds:
/// "2023-11-14T22:13:20.123456Z" (what JSON, YAML and CSV print). 0 prints as "".
std::string FormatUtcTimeUs(std::int64_t unix_us);
/// Name of a dtype, the one spelling used everywhere: "float16", "bfloat16", "float32"; "-"
/// when unspecified.
std::string DTypeName(int dtype);

/// JSON object of any message: every field of the message's descriptor (default values
/// included), 64-bit integers stay numbers, repeated fields are arrays, message fields nested
/// objects. One naming scheme, whatever the proto field says: a Unix time (`*_unix_ms`,
/// `*_unix_us`) becomes `*_time`, an RFC 3339 UTC string (null when unset); a duration
/// (`*_ms`, `*_us`, `*_s`) becomes `*_seconds`, a number; sizes are `*_bytes`; other keys
/// are the proto field names. Enums are their value names in lower case without the type's
/// prefix (`bfloat16`, `scatter_heads`), a number this build does not know stays a number.
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
/// {"status": "SERVING"} for the health command.
nlohmann::json HealthToJson(std::string_view status);
/// The DrainResponse that a state reports (what `drain --wait` prints once it has waited, and
/// what `undrain` prints: the same fields).
v1::DrainResponse DrainFromState(const v1::DaemonState& state);

/// Listings (table, wide, csv) of each answer; the Render* functions below are their tables.
Listing StateListing(const v1::DaemonState& state);
Listing ClientsListing(const v1::ListClientsResponse& response, std::int64_t now_unix_ms);
Listing GroupsListing(const v1::ListGroupsResponse& response);
Listing SessionsListing(const v1::ListSessionsResponse& response);
Listing SlotsListing(const v1::ListSlotsResponse& response);
Listing RecentCallsListing(const v1::ListRecentCallsResponse& response);
Listing DrainListing(const v1::DrainResponse& response);
Listing HealthListing(std::string_view status);

/// The text printed by `ulyssesctl COMMAND`. `now_unix_ms` is the current Unix time in
/// milliseconds, from which the clients' ages are computed.
std::string RenderState(const v1::DaemonState& state);
std::string RenderClients(const v1::ListClientsResponse& response, std::int64_t now_unix_ms);
std::string RenderGroups(const v1::ListGroupsResponse& response);
std::string RenderSessions(const v1::ListSessionsResponse& response);
std::string RenderSlots(const v1::ListSlotsResponse& response);
/// Times print as local time (FormatLocalTimeUs), durations as done - queued.
std::string RenderRecentCalls(const v1::ListRecentCallsResponse& response);
/// "draining; idle" or "draining; N call(s) running, M session(s) open" (one line); "serving"
/// instead of "draining" when the daemon does not drain (what undrain prints).
std::string RenderDrain(const v1::DrainResponse& response);


}  // namespace ulysses::ctl
