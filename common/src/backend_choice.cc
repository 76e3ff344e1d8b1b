#include "ulysses/common/backend_choice.h"

#include "absl/strings/numbers.h"
#include "ulysses/common/status.h"
#include "ulysses/common/strings.h"

namespace ulysses {
namespace {

constexpr std::string_view kAlsoNccl = "+nccl";

absl::Status Refused(const std::string& why) {
  return absl::FailedPreconditionError(StrCat("backend: ", why));
}

}  // namespace

std::string EncodeOffer(const BackendOffer& offer) {
  return StrCat(offer.backend, offer.nccl ? kAlsoNccl : "", ":", offer.device,
                offer.instance.empty() ? "" : "/", offer.instance);
}

absl::StatusOr<BackendOffer> DecodeOffer(std::string_view payload, int rank) {
  BackendOffer out;
  if (const size_t slash = payload.rfind('/'); slash != std::string_view::npos) {
    out.instance = std::string(payload.substr(slash + 1));
    payload = payload.substr(0, slash);
    if (out.instance.empty() || out.instance.size() > kMaxOfferInstanceChars ||
        out.instance.find_first_not_of("0123456789abcdef") != std::string::npos)
      return absl::FailedPreconditionError(
          StrCat("rank ", rank, " sent a malformed join payload (its instance)"));
  }
  const size_t colon = payload.rfind(':');
  std::string_view name = payload.substr(0, colon == std::string_view::npos ? 0 : colon);
  if (name.size() > kAlsoNccl.size() && name.substr(name.size() - kAlsoNccl.size()) == kAlsoNccl) {
    out.nccl = true;
    name.remove_suffix(kAlsoNccl.size());
  }
  out.backend = std::string(name);
  if (colon == std::string_view::npos || out.backend.empty() ||
      out.backend.find('+') != std::string::npos ||
      !absl::SimpleAtoi(absl::string_view(payload.data() + colon + 1, payload.size() - colon - 1),
                        &out.device))
    return absl::FailedPreconditionError(StrCat("rank ", rank, " sent a malformed join payload"));
  return out;
}

absl::StatusOr<BackendVerdict> ChooseGroupBackend(std::string_view requested,
                                                  const std::vector<BackendOffer>& offers,
                                                  const DeviceReach& reach) {
  if (offers.empty()) return absl::InvalidArgumentError("offers: none");
  const std::string& runs = offers[0].backend;
  int without_nccl = -1;  // the first rank that cannot run nccl
  for (size_t r = 0; r < offers.size(); ++r) {
    if (offers[r].backend != runs)
      return Refused(StrCat("rank ", r, " runs '", offers[r].backend, "', rank 0 '", runs, "'"));
    if (without_nccl < 0 && runs != "nccl" && !offers[r].nccl) without_nccl = static_cast<int>(r);
  }
  const std::string how = requested == "auto" ? "auto" : StrCat("requested ", requested);
  if (runs != "nvlink") {
    if (requested != "auto" && requested != runs)
      return Refused(StrCat("'", requested, "' asked for, but every rank's daemon runs ", runs));
    return BackendVerdict{runs, StrCat(how, ": every rank's daemon runs ", runs)};
  }
  if (requested == "nccl") {
    if (without_nccl >= 0)
      return Refused(StrCat("'nccl' asked for, but rank ", without_nccl,
                            "'s daemon runs nvlink without nccl"));
    return BackendVerdict{"nccl", StrCat(how, ": every rank's daemon also runs nccl")};
  }
  if (requested != "auto" && requested != "nvlink")
    return Refused(StrCat("'", requested, "' asked for, but every rank's daemon runs nvlink"));
  std::string blocked;  // the first ordered pair of ranks whose devices do not reach
  for (size_t from = 0; from < offers.size() && blocked.empty(); ++from)
    for (size_t to = 0; to < offers.size() && blocked.empty(); ++to) {
      if (from == to) continue;
      ULY_ASSIGN_OR_RETURN(const bool ok, reach(offers[from].device, offers[to].device));
      if (!ok)
        blocked = StrCat("rank ", to, "'s device ", offers[to].device, " cannot map rank ", from,
                         "'s device ", offers[from].device, " (no peer access)");
    }
  if (blocked.empty())
    return BackendVerdict{"nvlink",
                          StrCat(how, ": every pair of ranks' devices maps each other's memory")};
  if (requested == "nvlink") return Refused(StrCat("nvlink cannot run this group: ", blocked));
  if (without_nccl >= 0)
    return Refused(StrCat("nvlink cannot run this group (", blocked, ") and rank ", without_nccl,
                          "'s daemon has no nccl backend"));
  return BackendVerdict{"nccl", StrCat(how, ": ", blocked, ", so nccl")};
}

}  // namespace ulysses
