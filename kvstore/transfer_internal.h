// Pieces of the sending side shared by the transports (not part of the public interface).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dgserve/v1/worker.pb.h"
#include "kvstore/paged_kv_cache.h"

namespace dgserve::kv::internal {

// One block of an outgoing transfer.
struct OutgoingBlock {
  LayerKind kind = LayerKind::kFull;
  int32_t logical = 0;   // logical block index (position / block_size)
  int32_t physical = 0;  // block id in the sender's pool
};

// The header of a transfer of all committed positions of `kv`.
v1::KvTransferHeader MakeHeader(const std::string& request_id, const PagedKvCache& kv,
                                int64_t lease_ms);
// The blocks the descriptor announces, full blocks first, then sliding ones, in logical order.
std::vector<OutgoingBlock> BlocksToSend(const v1::KvDescriptor& descriptor,
                                        const PagedKvCache& kv);
// `block`'s payload: its raw floats (exactly BlockBytes bytes) and their FNV-1a 64 checksum.
void FillPayload(const PagedKvCache& kv, const OutgoingBlock& block, v1::KvBlockPayload* out);

// The node this process runs on, for KvPeerInfo: env NODE_NAME (Kubernetes), else the host name.
std::string KvNodeName();

}  // namespace dgserve::kv::internal
