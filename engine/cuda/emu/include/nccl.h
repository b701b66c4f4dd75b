// Emulation stand-in for NCCL's nccl.h (gpu-emu targets only; see nccl_emu.cc). The real NCCL
// needs GPUs; this emulation runs both ranks of a communicator inside one process so that the
// NCCL KV transport's logic (bootstrap, grouped send/receive, non-blocking initialisation,
// asynchronous errors, abort and re-creation) is tested without one. It moves bytes with memcpy
// and says nothing about NCCL's performance or its network behaviour.
#pragma once

#include <cstddef>
#include <cstdint>

#include "engine/cuda/emu/cuda_emu.h"

#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
  char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
} ncclResult_t;

typedef enum { ncclInt8 = 0, ncclChar = 0, ncclUint8 = 1, ncclFloat32 = 7, ncclFloat = 7 }
    ncclDataType_t;

struct ncclComm;
typedef struct ncclComm* ncclComm_t;

#define NCCL_CONFIG_UNDEF_INT INT32_MIN
typedef struct {
  int blocking;
} ncclConfig_t;
#define NCCL_CONFIG_INITIALIZER {NCCL_CONFIG_UNDEF_INT}

ncclResult_t ncclGetUniqueId(ncclUniqueId* unique_id);
// Joins the communicator `commId` as `rank` of `nranks` (2 only). Non-blocking (blocking = 0):
// returns ncclInProgress until every rank joined (ncclCommGetAsyncError says when); blocking:
// waits for them.
ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t* config);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error);
// Abort: outstanding operations end (their streams become idle), the peer sees ncclRemoteError.
ncclResult_t ncclCommAbort(ncclComm_t comm);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommCount(const ncclComm_t comm, int* count);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank);
// Point to point: a send of `count` elements to `peer` matches that peer's receive from this
// rank, in order; sizes must agree. Inside a group the operations are queued until
// ncclGroupEnd; each is outstanding work of `stream` until matched.
ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream);
ncclResult_t ncclGroupStart();
ncclResult_t ncclGroupEnd();
const char* ncclGetErrorString(ncclResult_t result);
const char* ncclGetLastError(ncclComm_t comm);

namespace dgserve::cuda::emu {

// Fault injection for tests: once this many bytes in total have been sent (over any
// communicator) since the fault was armed, the next send that crosses it fails (kFail: both
// communicators' asynchronous error becomes ncclSystemError / ncclRemoteError) or is never
// delivered (kHang: sender and receiver wait until someone aborts). One-shot.
enum class NcclFault { kNone, kFail, kHang };
void SetNcclFault(NcclFault fault, int64_t after_bytes);
// Communicators created since the process started (tests: a communicator was re-created).
int64_t NcclCommunicatorsCreated();

}  // namespace dgserve::cuda::emu
