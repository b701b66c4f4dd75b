// The emulated NCCL (include/nccl.h): two-rank communicators inside one process, point-to-point
// operations matched per (communicator, direction) and moved with memcpy. An emulation for tests
// of the NCCL KV transport without a GPU; see include/nccl.h.
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <vector>

#include "engine/cuda/emu/include/nccl.h"

namespace {

using dgserve::cuda::emu::NcclFault;

struct Op {
  char* data;
  size_t bytes;
  cudaStream_t stream;
};

// What both ranks of one communicator share.
struct Link {
  int joined = 0;
  ncclResult_t error[2] = {ncclSuccess, ncclSuccess};  // per rank
  bool aborted[2] = {false, false};
  std::deque<Op> sends[2];  // sends[r]: rank r → rank 1−r, not yet matched
  std::deque<Op> recvs[2];  // recvs[r]: rank r ← rank 1−r
  std::vector<Op> lost[2];  // rank r's sends swallowed by kHang
};

struct Global {
  std::mutex mu;
  std::condition_variable joined;
  std::map<std::string, std::shared_ptr<Link>> rendezvous;
  NcclFault fault = NcclFault::kNone;
  int64_t fault_after = 0;
  int64_t sent_since_armed = 0;
  int64_t created = 0;
};
Global& G() {
  static Global* const g = new Global;
  return *g;
}

struct PendingOp {
  bool send;
  ncclComm_t comm;
  int peer;
  Op op;
};
thread_local int t_group_depth = 0;
thread_local std::vector<PendingOp> t_group;

}  // namespace

struct ncclComm {
  std::shared_ptr<Link> link;
  int rank = 0;
  bool blocking = true;
};

namespace {

void EndAll(std::deque<Op>& q) {
  for (const Op& o : q) dgserve::cuda::emu::StreamWorkEnd(o.stream);
  q.clear();
}

// Matches queued sends with receives in both directions (under G().mu).
void MatchLocked(Link& l) {
  for (int r = 0; r < 2; ++r) {
    while (!l.sends[r].empty() && !l.recvs[1 - r].empty()) {
      const Op s = l.sends[r].front(), d = l.recvs[1 - r].front();
      if (s.bytes != d.bytes) {  // NCCL: undefined; here both ranks fail
        l.error[0] = l.error[1] = ncclInvalidUsage;
        return;
      }
      l.sends[r].pop_front();
      l.recvs[1 - r].pop_front();
      if (s.bytes > 0) std::memcpy(d.data, s.data, s.bytes);
      dgserve::cuda::emu::StreamWorkEnd(s.stream);
      dgserve::cuda::emu::StreamWorkEnd(d.stream);
    }
  }
}

ncclResult_t Post(const PendingOp& p) {
  Global& g = G();
  std::lock_guard<std::mutex> lock(g.mu);
  Link& l = *p.comm->link;
  const int r = p.comm->rank;
  if (l.aborted[r]) return ncclInvalidUsage;
  if (l.error[r] != ncclSuccess) return l.error[r];
  dgserve::cuda::emu::StreamWorkBegin(p.op.stream);
  if (p.send) {
    if (g.fault != NcclFault::kNone &&
        g.sent_since_armed + int64_t(p.op.bytes) > g.fault_after) {
      const NcclFault f = g.fault;
      g.fault = NcclFault::kNone;
      if (f == NcclFault::kFail) {
        l.error[r] = ncclSystemError;
        l.error[1 - r] = ncclRemoteError;
        dgserve::cuda::emu::StreamWorkEnd(p.op.stream);  // the op ends in error
        return ncclSuccess;  // reported asynchronously, as NCCL does
      }
      l.lost[r].push_back(p.op);  // kHang: never delivered
      return ncclSuccess;
    }
    g.sent_since_armed += int64_t(p.op.bytes);
    l.sends[r].push_back(p.op);
  } else {
    l.recvs[r].push_back(p.op);
  }
  MatchLocked(l);
  return ncclSuccess;
}

ncclResult_t Enqueue(bool send, const void* buf, size_t count, ncclDataType_t type, int peer,
                     ncclComm_t comm, cudaStream_t stream) {
  if (comm == nullptr || peer != 1 - comm->rank) return ncclInvalidArgument;
  const size_t elem = type == ncclFloat32 ? 4 : 1;
  const PendingOp p{send, comm, peer,
                    {static_cast<char*>(const_cast<void*>(buf)), count * elem, stream}};
  if (t_group_depth > 0) {
    t_group.push_back(p);
    return ncclSuccess;
  }
  const ncclResult_t r = Post(p);
  return r == ncclSuccess && !comm->blocking ? ncclInProgress : r;
}

}  // namespace

namespace dgserve::cuda::emu {

void SetNcclFault(NcclFault fault, int64_t after_bytes) {
  std::lock_guard<std::mutex> lock(G().mu);
  G().fault = fault;
  G().fault_after = after_bytes;
  G().sent_since_armed = 0;
}

int64_t NcclCommunicatorsCreated() {
  std::lock_guard<std::mutex> lock(G().mu);
  return G().created;
}

}  // namespace dgserve::cuda::emu

ncclResult_t ncclGetUniqueId(ncclUniqueId* unique_id) {
  static std::atomic<uint64_t> serial{0};
  std::random_device rd;
  std::memset(unique_id->internal, 0, sizeof(unique_id->internal));
  const uint64_t words[3] = {++serial, uint64_t(rd()) << 32 | rd(), uint64_t(rd())};
  std::memcpy(unique_id->internal, words, sizeof(words));
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                    ncclConfig_t* config) {
  if (nranks != 2 || rank < 0 || rank > 1) return ncclInvalidArgument;
  const bool blocking = config == nullptr || config->blocking != 0;
  Global& g = G();
  std::unique_lock<std::mutex> lock(g.mu);
  std::shared_ptr<Link>& slot = g.rendezvous[std::string(id.internal, sizeof(id.internal))];
  if (slot == nullptr) slot = std::make_shared<Link>();
  auto* c = new ncclComm{slot, rank, blocking};
  ++g.created;
  if (++slot->joined == 2) {
    g.rendezvous.erase(std::string(id.internal, sizeof(id.internal)));
    g.joined.notify_all();
  }
  *comm = c;
  if (!blocking) return c->link->joined == 2 ? ncclSuccess : ncclInProgress;
  g.joined.wait(lock, [&] { return c->link->joined == 2; });
  return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* async_error) {
  if (comm == nullptr) return ncclInvalidArgument;
  std::lock_guard<std::mutex> lock(G().mu);
  const Link& l = *comm->link;
  *async_error = l.error[comm->rank] != ncclSuccess ? l.error[comm->rank]
                 : l.joined < 2                     ? ncclInProgress
                                                    : ncclSuccess;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (comm == nullptr) return ncclSuccess;
  {
    std::lock_guard<std::mutex> lock(G().mu);
    Link& l = *comm->link;
    const int r = comm->rank;
    l.aborted[r] = true;
    EndAll(l.sends[r]);
    EndAll(l.recvs[r]);
    for (const Op& o : l.lost[r]) dgserve::cuda::emu::StreamWorkEnd(o.stream);
    l.lost[r].clear();
    if (!l.aborted[1 - r] && l.error[1 - r] == ncclSuccess) l.error[1 - r] = ncclRemoteError;
  }
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) { return ncclCommAbort(comm); }

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  *count = 2;
  return comm == nullptr ? ncclInvalidArgument : ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (comm == nullptr) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return Enqueue(true, sendbuff, count, datatype, peer, comm, stream);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer,
                      ncclComm_t comm, cudaStream_t stream) {
  return Enqueue(false, recvbuff, count, datatype, peer, comm, stream);
}

ncclResult_t ncclGroupStart() {
  ++t_group_depth;
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  if (t_group_depth == 0) return ncclInvalidUsage;
  if (--t_group_depth > 0) return ncclSuccess;
  std::vector<PendingOp> ops;
  ops.swap(t_group);
  ncclResult_t result = ncclSuccess;
  bool non_blocking = false;
  for (const PendingOp& p : ops) {
    non_blocking |= !p.comm->blocking;
    if (ncclResult_t r = Post(p); r != ncclSuccess && result == ncclSuccess) result = r;
  }
  return result == ncclSuccess && non_blocking ? ncclInProgress : result;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess:
      return "no error (emulated NCCL)";
    case ncclSystemError:
      return "unhandled system error (emulated NCCL; fault injection)";
    case ncclRemoteError:
      return "remote process exited or there was a network error (emulated NCCL)";
    case ncclInvalidArgument:
      return "invalid argument (emulated NCCL)";
    case ncclInvalidUsage:
      return "invalid usage (emulated NCCL)";
    case ncclInProgress:
      return "NCCL operation in progress (emulated NCCL)";
    default:
      return "internal error (emulated NCCL)";
  }
}

const char* ncclGetLastError(ncclComm_t) { return ""; }
