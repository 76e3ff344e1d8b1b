/* The stable C ABI of libulysses_client.so.
 *
 * Everything crossing it is a C type: opaque handles, fixed-width integers, C strings and
 * structs whose first member is their own size (`struct_size`), so that fields can be
 * appended in later versions without breaking callers compiled against this one. Every
 * fallible function returns a uly_status (ULY_OK = 0); on failure, uly_last_error() gives
 * the message of the last failed call on the calling thread (the daemon's message when the
 * daemon refused).
 *
 * Versioning: ULY_ABI_VERSION = major << 16 | minor. A caller compiled with major M and
 * minor m works with any library of major M and minor >= m; uly_connect checks the version
 * the caller passes and refuses another major (ULY_FAILED_PRECONDITION). A minor version adds
 * functions or gives reserved values a meaning, never changes what exists. 1.1: CUDA tensors
 * (ULY_DEVICE_CUDA), per-call streams and device results on GPU-backend sessions;
 * uly_cuda_built. 1.2: the fused session (uly_session_create_fused,
 * uly_session_qkv_norm_rope_exchange), ULY_DTYPE_INT32 for its positions, uly_session_describe.
 * 1.3: DLPack export of results (uly_result_to_dlpack, uly_dlpack_free). 1.4: fused calls
 * through the rings (uly_session_qkv_norm_rope_submit, uly_session_qkv_norm_rope_wait).
 * 1.5: uly_stream_wait (a consumer stream ordered after a producer stream), uly_group_leave.
 *
 * Thread-safety: a uly_client may be used from several threads at once; each uly_session
 * from one thread at a time (calls on a session are ordered, like work on a CUDA stream).
 * uly_result handles may be released and freed from any thread.
 *
 * docs/api.md section 9 describes every function; section 4 of that document lists when
 * each status code is returned.
 */
#ifndef ULYSSES_C_API_H_
#define ULYSSES_C_API_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define ULY_API __attribute__((visibility("default")))
#else
#define ULY_API
#endif

/** The ABI version of this header: major << 16 | minor. */
#define ULY_ABI_VERSION_MAJOR 1
#define ULY_ABI_VERSION_MINOR 5
#define ULY_ABI_VERSION ((ULY_ABI_VERSION_MAJOR << 16) | ULY_ABI_VERSION_MINOR)

/** Most dimensions a uly_tensor describes. The head-exchange ops take 4. */
#define ULY_MAX_DIMS 8

/** Status codes. The values are those of absl::StatusCode and grpc::StatusCode. */
typedef enum uly_status {
  ULY_OK = 0,
  ULY_CANCELLED = 1,
  ULY_UNKNOWN = 2,
  ULY_INVALID_ARGUMENT = 3,    /**< bad shape, stride, band, dtype, handle; names the argument */
  ULY_DEADLINE_EXCEEDED = 4,   /**< missing ranks, peer or slot waits past their bound */
  ULY_NOT_FOUND = 5,
  ULY_ALREADY_EXISTS = 6,
  ULY_PERMISSION_DENIED = 7,
  ULY_RESOURCE_EXHAUSTED = 8,  /**< capacity (max_tokens), slot memory */
  ULY_FAILED_PRECONDITION = 9, /**< session or slot state, ABI version, backend, no CUDA */
  ULY_ABORTED = 10,            /**< a peer failed, closed or died during a call */
  ULY_OUT_OF_RANGE = 11,
  ULY_UNIMPLEMENTED = 12,      /**< Submit without rings; a CUDA VMM tensor without the opt-in */
  ULY_INTERNAL = 13,
  ULY_UNAVAILABLE = 14,        /**< no daemon, daemon gone or draining */
  ULY_DATA_LOSS = 15,
  ULY_UNAUTHENTICATED = 16
} uly_status;

/** Element types. The values match ulysses.v1.DType. */
typedef enum uly_dtype {
  ULY_DTYPE_UNSPECIFIED = 0,
  ULY_DTYPE_FLOAT16 = 1,
  ULY_DTYPE_BFLOAT16 = 2,
  ULY_DTYPE_FLOAT32 = 3,
  /** Since 1.2: the positions of a fused call only (no session takes it as its dtype). */
  ULY_DTYPE_INT32 = 4
} uly_dtype;

/** Where a tensor's memory lives. */
typedef enum uly_device_kind {
  ULY_DEVICE_UNSPECIFIED = 0,
  /** A shared host buffer of this client (uly_buffer_alloc): buffer_id + byte_offset, or a
   *  `data` pointer into such a buffer. */
  ULY_DEVICE_HOST = 1,
  /** CUDA device memory: `data` is the device pointer (cudaMalloc'd memory of this process,
   *  e.g. a tensor of a caching allocator), device_index its device. GPU-backend sessions
   *  only; a result of kind CUDA is device memory. */
  ULY_DEVICE_CUDA = 2
} uly_device_kind;

/** The operations of a head-exchange session. The values match ulysses.v1.OpKind. */
typedef enum uly_op {
  ULY_OP_UNSPECIFIED = 0,
  ULY_OP_SCATTER_HEADS = 1,            /**< x[B,S_l,H,D] -> [B,S_g,H_l,D] */
  ULY_OP_GATHER_HEADS = 2,             /**< y[B,S_g,H_l,D] -> [B,S_l,H,D] */
  ULY_OP_SCATTER_QKV_HEAD_CHUNK = 3,   /**< q,k,v[B,S_l,H,D] -> [B,S_g,HC,3D] */
  ULY_OP_GATHER_OUTPUT_HEAD_CHUNK = 4  /**< x[B,S_g,HC,D] -> band of out[B,S_l,H,D] */
} uly_op;

typedef struct uly_client uly_client;
typedef struct uly_buffer uly_buffer;
typedef struct uly_group uly_group;
typedef struct uly_session uly_session;
typedef struct uly_result uly_result;

/* ---------------------------------------------------------------------------------------- */
/* Library and errors                                                                        */

/** The ABI version the library implements (ULY_ABI_VERSION of the header it was built with). */
ULY_API uint32_t uly_abi_version(void);
/** 1 if the library was built with CUDA (it can take CUDA tensors and streams on GPU-backend
 *  sessions), else 0. Since ABI 1.1. */
ULY_API int32_t uly_cuda_built(void);
/** The library's release version, e.g. "0.1.0". Static storage. */
ULY_API const char* uly_version(void);
/** The message of the last call on this thread that did not return ULY_OK ("" if none).
 *  Valid until the thread's next failing call. */
ULY_API const char* uly_last_error(void);
/** "OK", "INVALID_ARGUMENT", ...; "UNKNOWN" for a value outside the enum. Static storage. */
ULY_API const char* uly_status_name(int32_t status);

/* ---------------------------------------------------------------------------------------- */
/* Client                                                                                    */

/** How to reach a daemon. Zero-initialise, then set struct_size and abi_version. */
typedef struct uly_connect_options {
  uint32_t struct_size;  /**< sizeof(uly_connect_options) */
  uint32_t abi_version;  /**< ULY_ABI_VERSION; checked against the library's */
  /** Control socket path (or a "unix:" target). NULL or "": $ULYSSES_SOCKET if set, else
   *  /run/ulysses/gpu<device>.sock. */
  const char* socket;
  const char* name;            /**< shown to operators; NULL: "" */
  int32_t device;              /**< device index for the default socket; < 0: 0 */
  /** 0 (default): calls go through the shared-memory rings; 1: every call is an RPC.
   *  Results are the same either way. */
  int32_t disable_rings;
  int64_t connect_timeout_ms;  /**< 0: 10000 */
} uly_connect_options;

/** Connects, attaches, binds the fd socket and maps the call rings. ULY_UNAVAILABLE when no
 *  daemon answers in time; ULY_FAILED_PRECONDITION when options->abi_version has another
 *  major version than the library (or a newer minor). On success *out owns the client. */
ULY_API uly_status uly_connect(const uly_connect_options* options, uly_client** out);
/** Detaches: the daemon releases every buffer, session and slot of this client. Handles made
 *  from it stay valid to free, but their calls fail. Idempotent. */
ULY_API uly_status uly_client_close(uly_client* client);
/** Closes (if open) and frees the handle. NULL is ignored. */
ULY_API void uly_client_free(uly_client* client);
/** The daemon's id for this client. */
ULY_API uint64_t uly_client_id(const uly_client* client);
/** The backend the daemon runs ("host", ...); valid while the handle lives. */
ULY_API const char* uly_client_backend(const uly_client* client);
/** The control socket this client connected to (after the defaults of uly_connect_options
 *  were applied); valid while the handle lives. Other ranks join a group through it. */
ULY_API const char* uly_client_socket(const uly_client* client);
/** 1 if calls go through the shared-memory rings, 0 if through RPCs. */
ULY_API int32_t uly_client_uses_rings(const uly_client* client);

/* ---------------------------------------------------------------------------------------- */
/* Shared buffers                                                                            */

/** A new zero-filled shared host buffer of size_bytes, mapped read-write here and in the
 *  daemon. The mapping stays valid until uly_buffer_free, even after the client closes. */
ULY_API uly_status uly_buffer_alloc(uly_client* client, uint64_t size_bytes, const char* name,
                                    uly_buffer** out);
/** Gives the buffer back to the daemon and unmaps it. NULL is ignored. */
ULY_API uly_status uly_buffer_free(uly_buffer* buffer);
ULY_API uint64_t uly_buffer_id(const uly_buffer* buffer);
ULY_API void* uly_buffer_data(const uly_buffer* buffer);
ULY_API uint64_t uly_buffer_size(const uly_buffer* buffer);

/* ---------------------------------------------------------------------------------------- */
/* Groups                                                                                    */

/** What uly_join_group needs. Every rank passes the same name, world size and members. */
typedef struct uly_group_spec {
  uint32_t struct_size;         /**< sizeof(uly_group_spec) */
  int32_t world_size;           /**< W */
  int32_t rank;                 /**< this rank, in [0, W) */
  int32_t num_members;          /**< W, or 0 when world_size is 1 and members is NULL */
  const char* name;             /**< the group's name, the same on every rank */
  const char* const* members;   /**< members[r] = rank r's daemon socket */
  const char* backend;          /**< "auto" (NULL) or "host" in this build */
  int64_t timeout_ms;           /**< 0: the daemon's peer timeout */
} uly_group_spec;

/** Collective: joins (forms) the group with the other ranks' daemons. */
ULY_API uly_status uly_join_group(uly_client* client, const uly_group_spec* spec, uly_group** out);
/** Frees the handle (the group stays joined until the client detaches). NULL is ignored. */
ULY_API void uly_group_free(uly_group* group);
ULY_API uint64_t uly_group_id(const uly_group* group);
ULY_API int32_t uly_group_rank(const uly_group* group);
ULY_API int32_t uly_group_world_size(const uly_group* group);
/** The resolved backend and why it was chosen; valid while the handle lives. */
ULY_API const char* uly_group_backend(const uly_group* group);
ULY_API const char* uly_group_backend_reason(const uly_group* group);
/** Leaves the group (since ABI 1.5): its sessions must all be closed first
 *  (ULY_FAILED_PRECONDITION naming one that is not; ULY_NOT_FOUND when it was left already).
 *  The other ranks' later sessions of the group then fail at once with ULY_ABORTED naming
 *  this rank. The handle stays valid for uly_group_free. */
ULY_API uly_status uly_group_leave(uly_group* group);

/* ---------------------------------------------------------------------------------------- */
/* Sessions                                                                                  */

/** A head-exchange session's geometry (world size and rank come from the group). */
typedef struct uly_session_spec {
  uint32_t struct_size;      /**< sizeof(uly_session_spec) */
  int32_t num_heads;         /**< H */
  int32_t head_dim;          /**< D */
  int32_t dtype;             /**< uly_dtype */
  int64_t max_tokens;        /**< bound on B*S_l of every call */
  int32_t num_slots;         /**< receive slots, 1..8; 0: 2 */
  int32_t schedule_length;   /**< entries in schedule; 0: none */
  const int32_t* schedule;   /**< optional head-chunk schedule summing to H/W */
  int64_t timeout_ms;        /**< 0: the daemon's peer timeout */
} uly_session_spec;

/** Collective over the group: every rank passes the same spec. */
ULY_API uly_status uly_session_create(uly_client* client, const uly_group* group,
                                      const uly_session_spec* spec, uly_session** out);
/** Closes the session on this rank. Results still alive keep the receive slots mapped (their
 *  data stays readable) until they are freed. On a GPU session the calls already made run to
 *  their end first (waited for up to 10 s; past that the close aborts them). Idempotent. */
ULY_API uly_status uly_session_close(uly_session* session);
/** Closes (if open) and frees the handle. NULL is ignored. */
ULY_API void uly_session_free(uly_session* session);
ULY_API uint64_t uly_session_id(const uly_session* session);
/** The session's resolved backend; valid while the handle lives. */
ULY_API const char* uly_session_backend(const uly_session* session);
/** Fills this rank's receive slots that are not held with NaN; *poisoned (may be NULL) gets
 *  how many. Not collective. For tests. */
ULY_API uly_status uly_session_poison_slots(uly_session* session, int32_t* poisoned);

/* ---------------------------------------------------------------------------------------- */
/* Tensors and calls                                                                         */

/** A strided tensor. Zero-initialise, then set struct_size.
 *  Host tensors (device_kind ULY_DEVICE_HOST) name a shared buffer of this client: either
 *  buffer_id + byte_offset, or buffer_id 0 and `data` pointing into a buffer mapping that
 *  uly_buffer_alloc returned (the library finds the buffer).
 *  CUDA tensors (ULY_DEVICE_CUDA, GPU-backend sessions) give the device pointer in `data`
 *  (plus byte_offset, usually 0), buffer_id 0, and the pointer's device in device_index. The
 *  allocation holding `data` is handed to the daemon by CUDA IPC on first use and cached by
 *  its CUDA buffer id: later calls on the same allocation cost no registration, and memory
 *  freed and allocated again at the same address is registered afresh. Memory of cuMemCreate
 *  allocations (torch's expandable segments) goes as the POSIX fds of the mappings it covers,
 *  at most 64, each exportable as a POSIX fd (else ULY_INVALID_ARGUMENT). On a host-backend session a CUDA tensor is ULY_INVALID_ARGUMENT; in a
 *  library built without CUDA (uly_cuda_built() == 0) ULY_FAILED_PRECONDITION. Both name the
 *  tensor. */
typedef struct uly_tensor {
  uint32_t struct_size;    /**< sizeof(uly_tensor) */
  int32_t device_kind;     /**< uly_device_kind */
  int32_t dtype;           /**< uly_dtype; must equal the session's */
  int32_t ndim;            /**< dimensions in shape/strides (4 for the head-exchange ops) */
  uint64_t buffer_id;      /**< host: the shared buffer, or 0 to locate `data` */
  uint64_t byte_offset;    /**< host: offset of element [0,...,0] in the buffer */
  void* data;              /**< host: a pointer into a buffer (buffer_id 0); CUDA: device pointer */
  int32_t device_index;    /**< CUDA: the device ordinal of `data` */
  int32_t reserved;        /**< must be 0 */
  int64_t shape[ULY_MAX_DIMS];
  int64_t strides[ULY_MAX_DIMS];  /**< in elements; all zero: contiguous (row-major) */
} uly_tensor;

/** One call of a head-exchange session. Zero-initialise, then set struct_size. */
typedef struct uly_call_args {
  uint32_t struct_size;       /**< sizeof(uly_call_args) */
  int32_t op;                 /**< uly_op */
  int32_t head_offset;        /**< head-chunk ops: first local head of the band */
  int32_t head_count;         /**< head-chunk ops: heads in the band (HC) */
  /** x | y | q,k,v | x, by op; the unused ones NULL. B and the sequence extent are taken
   *  from inputs[0]'s shape, and every input's shape is checked against the op. */
  const uly_tensor* inputs[3];
  /** Optional for ops 1-3 (the result is copied there and the slot released at once),
   *  required for op 4. */
  const uly_tensor* out;
  /** GPU-backend sessions: the cudaStream_t whose work produces the inputs (and consumes the
   *  results). Calls are stream-ordered: the call runs after the work enqueued on it so far,
   *  returns once submitted, and its result is valid for work enqueued on the stream
   *  afterwards; an error found later is returned by the session's next call. NULL: the
   *  legacy default stream. On a host-backend session it must be NULL
   *  (ULY_INVALID_ARGUMENT otherwise; ULY_FAILED_PRECONDITION in a library without CUDA). */
  void* stream;
  int64_t timeout_ms;         /**< uly_session_wait only: 0 = 5 minutes */
} uly_call_args;

/** What a result describes. A fused call's results describe one plane each (bshd) or the
 *  whole [B,S_g,H_l,3D] band (fused). */
typedef struct uly_result_info {
  uint32_t struct_size;   /**< set by the caller: sizeof(uly_result_info) */
  int32_t slot;           /**< receive slot, (epoch-1) % num_slots */
  uint64_t epoch;         /**< the session's call counter, from 1, the same on every rank */
  int32_t device_kind;    /**< of `data`: ULY_DEVICE_CUDA (device memory, GPU backends) or HOST */
  int32_t dtype;          /**< uly_dtype */
  int32_t ndim;           /**< 4 */
  int32_t held;           /**< 1 while the result holds its slot */
  int64_t shape[ULY_MAX_DIMS];    /**< the result's shape */
  int64_t strides[ULY_MAX_DIMS];  /**< element strides of `data` (contiguous) */
  /** The result in the receive slot, read-only (a device pointer when device_kind is
   *  ULY_DEVICE_CUDA: the slot is mapped read-only on the device, and a kernel writing there
   *  faults); NULL unless held. */
  const void* data;
  uint64_t bytes;         /**< bytes at `data` */
  int64_t daemon_us;      /**< time the daemon spent on the call */
} uly_result_info;

/** Runs one call (collective: every rank issues the same calls in the same order) and
 *  returns when this rank's result is complete. *result (may be NULL when out is given)
 *  gets a handle on the result; free it with uly_result_free. */
ULY_API uly_status uly_session_call(uly_session* session, const uly_call_args* args,
                                    uly_result** result);
/** Queues a call through the rings and returns its epoch at once; uly_session_wait gives
 *  its result. ULY_UNIMPLEMENTED without rings. */
ULY_API uly_status uly_session_submit(uly_session* session, const uly_call_args* args,
                                      uint64_t* epoch);
/** Waits (timeout_ms; 0 = 5 minutes) for the result of a submitted call. */
ULY_API uly_status uly_session_wait(uly_session* session, uint64_t epoch, int64_t timeout_ms,
                                    uly_result** result);

/** Fills *info (info->struct_size set by the caller). */
ULY_API uly_status uly_result_get_info(const uly_result* result, uly_result_info* info);
/** Gives the receive slot back now; the data must not be read afterwards. Idempotent. */
ULY_API uly_status uly_result_release(uly_result* result);
/** Releases (if still held) and frees the handle. NULL is ignored. A result exported with
 *  uly_result_to_dlpack stays held until its DLPack tensor is deleted too. */
ULY_API void uly_result_free(uly_result* result);
/** A DLPack view of a held result (since ABI 1.3): *managed gets a `DLManagedTensor*`
 *  (dlpack.h, DLPACK_VERSION 0.6 and later; kDLCUDA or kDLCPU, the session's dtype, the
 *  result's shape, contiguous strides). The tensor holds its own reference on the result: the
 *  slot stays held until uly_result_release, or until both the handle is freed and the
 *  tensor's deleter has run (the consumer calls it, e.g. when torch frees the storage). Wrap
 *  it in a PyCapsule named "dltensor" for torch.utils.dlpack.from_dlpack; a tensor that no
 *  consumer took is given back with uly_dlpack_free. FAILED_PRECONDITION when the result
 *  holds no slot (released, or copied to out). */
ULY_API uly_status uly_result_to_dlpack(uly_result* result, void** managed);
/** Runs the deleter of a DLManagedTensor that uly_result_to_dlpack made and no consumer
 *  took. NULL is ignored. */
ULY_API void uly_dlpack_free(void* managed);
/** Enqueues on CUDA stream `consumer` a wait for the work enqueued on stream `producer` so far
 *  (since ABI 1.5): an event recorded on `producer` and waited on by `consumer`, so no host
 *  thread waits. Each is a cudaStream_t; NULL is the legacy default stream. Nothing when both
 *  are the same. What a consumer of a device result on another stream than its call's needs
 *  first (the DLPack exchange protocol's `stream`). UNIMPLEMENTED in a library built without
 *  CUDA; INTERNAL with CUDA's message when a stream is not valid. */
ULY_API uly_status uly_stream_wait(void* consumer, void* producer);

/* ---------------------------------------------------------------------------------------- */
/* The fused session: qkv_norm_rope_exchange (since ABI 1.2)                                 */

/** How a fused call's result is laid out. The values match ulysses::QkvLayout. */
typedef enum uly_qkv_layout {
  ULY_QKV_LAYOUT_UNSPECIFIED = 0,
  ULY_QKV_LAYOUT_BSHD = 1,   /**< q, k, v each [B,S_g,H_l,D], one after the other in the slot */
  ULY_QKV_LAYOUT_FUSED = 2   /**< one [B,S_g,H_l,3D]: q, k, v in [0,D), [D,2D), [2D,3D) */
} uly_qkv_layout;

/** Which GPU path runs a fused session's calls. The values match ulysses::FusedPath. The host
 *  backend runs its reference whatever the path. */
typedef enum uly_fused_path {
  ULY_FUSED_PATH_AUTO = 0,          /**< the daemon's rule per row count */
  ULY_FUSED_PATH_PER_OPERATOR = 1,  /**< GEMM, then norm + RoPE, then the stores */
  ULY_FUSED_PATH_CHUNKED = 2,       /**< GEMM by token block, each block's epilogue overlapped */
  ULY_FUSED_PATH_EPILOGUE = 3       /**< one GEMM whose epilogue does norm + RoPE + stores */
} uly_fused_path;

/** Most results one fused call returns (q, k, v of layout bshd). */
#define ULY_MAX_FUSED_RESULTS 3

/** A qkv_norm_rope_exchange session's geometry and weights (world size and rank come from the
 *  group). Zero-initialise, then set struct_size. The weights are uly_tensors, contiguous
 *  (strides all zero or row-major) and 32-byte aligned: host tensors in this client's shared
 *  buffers (buffer_id + byte_offset, or data) on the host backend, CUDA tensors (registered
 *  like call operands) on a GPU backend. The daemon reads them at every call: they must stay
 *  allocated and unchanged for the session's lifetime. */
typedef struct uly_fused_session_spec {
  uint32_t struct_size;     /**< sizeof(uly_fused_session_spec) */
  int32_t hidden;           /**< = num_heads * head_dim, a multiple of 64 */
  int32_t num_heads;        /**< H, divisible by the world size */
  int32_t head_dim;         /**< D: even; 128 on a GPU backend */
  int32_t layout;           /**< uly_qkv_layout; UNSPECIFIED is refused */
  int32_t path;             /**< uly_fused_path */
  int32_t num_slots;        /**< receive slots, 1..8; 0: 2 */
  int32_t max_pos;          /**< rows of the cos/sin table; positions lie in [0, max_pos) */
  int64_t max_tokens;       /**< bound on B*S_l of every call */
  const uly_tensor* w_qkv;    /**< bf16 [3*H*D, hidden]: Q, K, V planes in order, head-major */
  const uly_tensor* q_norm;   /**< bf16 [D] */
  const uly_tensor* k_norm;   /**< bf16 [D] */
  const uly_tensor* cos_sin;  /**< fp32 [max_pos, D]: cos in [0, D/2), sin in [D/2, D) */
  int64_t timeout_ms;       /**< 0: the daemon's peer timeout */
} uly_fused_session_spec;

/** Collective over the group: every rank passes the same geometry and path, and its own
 *  weights (checked here and by the daemon before the rendezvous; weights refused on one rank
 *  fail every rank). The session's dtype is bfloat16. */
ULY_API uly_status uly_session_create_fused(uly_client* client, const uly_group* group,
                                            const uly_fused_session_spec* spec,
                                            uly_session** out);

/** One call of a fused session. Zero-initialise, then set struct_size. */
typedef struct uly_fused_call_args {
  uint32_t struct_size;          /**< sizeof(uly_fused_call_args) */
  int32_t reserved;              /**< must be 0 */
  const uly_tensor* x;           /**< bf16 [B, S_l, hidden], contiguous, 32-byte aligned */
  const uly_tensor* positions;   /**< ULY_DTYPE_INT32 [B, S_l], contiguous */
  /** Optional: bf16, contiguous; [3, B, S_g, H_l, D] (q, k, v planes) for layout bshd,
   *  [B, S_g, H_l, 3D] for layout fused. The result is copied there and the slot released at
   *  once. It may overlap neither x, positions nor a weight. */
  const uly_tensor* out;
  /** As uly_call_args.stream: GPU-backend sessions only, NULL: the legacy default stream. */
  void* stream;
} uly_fused_call_args;

/** Runs one fused call (collective) and returns when this rank's head band is complete.
 *  results (an array of ULY_MAX_FUSED_RESULTS handles; may be NULL when args->out is given)
 *  gets q, k, v (layout bshd) or the one band (layout fused), and *num_results (may be NULL)
 *  how many. The handles of one call share its receive slot: it stays held until every one of
 *  them is freed, or until any one of them is released (that releases it for all; the others'
 *  data must not be read afterwards). Free each handle with uly_result_free. With out, the
 *  results hold nothing and describe no data (info.data NULL). */
ULY_API uly_status uly_session_qkv_norm_rope_exchange(uly_session* session,
                                                      const uly_fused_call_args* args,
                                                      uly_result** results,
                                                      int32_t* num_results);

/** Queues one fused call through the rings and returns its epoch at once (since ABI 1.4);
 *  uly_session_qkv_norm_rope_wait gives its results. x, positions and out must stay unchanged
 *  until then. ULY_UNIMPLEMENTED without rings. */
ULY_API uly_status uly_session_qkv_norm_rope_submit(uly_session* session,
                                                    const uly_fused_call_args* args,
                                                    uint64_t* epoch);
/** Waits (timeout_ms; 0 = 5 minutes) for a submitted fused call and fills results and
 *  *num_results as uly_session_qkv_norm_rope_exchange does (results may be NULL when the call
 *  was given out). Since ABI 1.4. */
ULY_API uly_status uly_session_qkv_norm_rope_wait(uly_session* session, uint64_t epoch,
                                                  int64_t timeout_ms, uly_result** results,
                                                  int32_t* num_results);

/** describe(): how the session's calls run on the daemon (for a fused session the path per
 *  prepared row count and why). *text is valid until the next uly_session_describe on this
 *  handle or its free. Since ABI 1.2; works on every session kind. */
ULY_API uly_status uly_session_describe(uly_session* session, const char** text);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif /* ULYSSES_C_API_H_ */
