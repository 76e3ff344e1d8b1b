// cuBLASLt error discipline and owners of its handles for the kernels target. Include only from
// CUDA-aware sources.
#pragma once

#include <cublasLt.h>

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace ulysses::kernels::internal {

/// INTERNAL "call: CUBLAS_STATUS_NAME (description) at file:line", file without its directory.
inline absl::Status CublasError(absl::string_view call, cublasStatus_t status,
                                absl::string_view file, int line) {
  const size_t slash = file.find_last_of('/');
  if (slash != absl::string_view::npos) file.remove_prefix(slash + 1);
  return absl::InternalError(absl::StrCat(call, ": ", cublasLtGetStatusName(status), " (",
                                          cublasLtGetStatusString(status), ") at ", file, ":",
                                          line));
}

}  // namespace ulysses::kernels::internal

/// Returns an INTERNAL status from the enclosing function when the cuBLAS(Lt) call fails.
#define ULY_CUBLAS_RETURN_IF_ERROR(call)                                                    \
  do {                                                                                      \
    const cublasStatus_t uly_cublas_status_ = (call);                                       \
    if (uly_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                        \
      return ::ulysses::kernels::internal::CublasError(#call, uly_cublas_status_, __FILE__, \
                                                       __LINE__);                           \
  } while (0)

namespace ulysses::kernels::internal {

/// Owns one cuBLASLt object of type T, destroyed with Destroy; movable, not copyable.
template <typename T, cublasStatus_t (*Destroy)(T)>
class LtOwner {
 public:
  LtOwner() = default;
  ~LtOwner() {
    if (value_ != nullptr) Destroy(value_);
  }
  LtOwner(LtOwner&& other) noexcept : value_(std::exchange(other.value_, nullptr)) {}
  LtOwner& operator=(LtOwner&& other) noexcept {
    if (this != &other) {
      if (value_ != nullptr) Destroy(value_);
      value_ = std::exchange(other.value_, nullptr);
    }
    return *this;
  }
  LtOwner(const LtOwner&) = delete;
  LtOwner& operator=(const LtOwner&) = delete;
  T get() const { return value_; }

 protected:
  T value_ = nullptr;
};

/// cublasLtMatmulDesc_t.
class LtMatmulDesc : public LtOwner<cublasLtMatmulDesc_t, cublasLtMatmulDescDestroy> {
 public:
  absl::Status Init(cublasComputeType_t compute, cudaDataType_t scale) {
    ULY_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulDescCreate(&value_, compute, scale));
    return absl::OkStatus();
  }
};

/// cublasLtMatmulPreference_t.
class LtPreference : public LtOwner<cublasLtMatmulPreference_t, cublasLtMatmulPreferenceDestroy> {
 public:
  absl::Status Init() {
    ULY_CUBLAS_RETURN_IF_ERROR(cublasLtMatmulPreferenceCreate(&value_));
    return absl::OkStatus();
  }
};

/// A bf16 column-major cublasLtMatrixLayout_t of rows x cols with leading dimension ld.
class LtLayout : public LtOwner<cublasLtMatrixLayout_t, cublasLtMatrixLayoutDestroy> {
 public:
  static absl::StatusOr<LtLayout> Create(int64_t rows, int64_t cols, int64_t ld) {
    LtLayout layout;
    ULY_CUBLAS_RETURN_IF_ERROR(cublasLtMatrixLayoutCreate(
        &layout.value_, CUDA_R_16BF, static_cast<uint64_t>(rows), static_cast<uint64_t>(cols), ld));
    return layout;
  }
};

}  // namespace ulysses::kernels::internal
