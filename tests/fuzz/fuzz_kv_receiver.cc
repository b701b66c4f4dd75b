// Fuzzes the KV transfer receiver as a peer drives it over KvTransferService.PushBlocks
// (ReceiveKvStream over KvReceiver: header and descriptor checks, block payloads, trailer),
// interleaved with what the denoise worker does (Expect, Forget) and with lease expiry.
//
// Input: frames of [tag u8][length u16 LE][length bytes]. tag & 7 says what the frame is:
//   0 a KvTransferHeader, 1 a KvBlockPayload, 2 a KvTransferTrailer (each in protobuf wire
//     format, sent as one chunk of the current stream), 3 a raw KvChunk;
//   4 end of the current stream (it is received; the next chunk starts a new one);
//   5 Expect(bytes as the request id), 6 Forget(bytes), 7 ReapExpired(now + length seconds).
// For blocks, tag bit 0x40 pads or cuts `data` to the block size of its kind and bit 0x80 sets
// the right checksum, as an honest (or clever) peer would, so the search gets past both checks.
// After every input the receiver is destroyed and the pool must have every block back.
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/hash.h"
#include "engine/model/config.h"
#include "kvstore/transfer_service.h"
#include "tests/fuzz/fuzz_util.h"

namespace {

using dgserve::fuzz::Check;
namespace kv = dgserve::kv;
namespace v1 = dgserve::v1;

constexpr int kMaxTokens = 64;

// Layers S F (one KV head of 2 each), window 6, blocks of 4 positions: 64-byte blocks.
kv::KvLayout SmallLayout() {
  dgserve::ModelConfig c;
  c.num_layers = 2;
  c.num_kv_heads = 1;
  c.num_global_kv_heads = 1;
  c.head_dim = 2;
  c.global_head_dim = 2;
  c.sliding_window = 6;
  c.layer_types = {dgserve::LayerType::kSliding, dgserve::LayerType::kFull};
  return kv::KvLayout::FromConfig(c, /*block_size=*/4, "fuzz-model");
}

kv::BlockPool& SharedPool() {
  static kv::BlockPool* pool = [] {
    auto p = kv::BlockPool::Create(SmallLayout(), /*sliding_blocks=*/24, /*full_blocks=*/24);
    if (!p.ok()) dgserve::fuzz::Fail(p.status().ToString());
    return p->release();
  }();
  return *pool;
}

void CheckStatus(const absl::Status& s) {
  if (s.ok()) return;
  switch (s.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kResourceExhausted:
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kNotFound:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kDataLoss:
      break;
    default:
      dgserve::fuzz::Fail("unexpected status: " + s.ToString());
  }
  Check(!s.message().empty(), "error without a message");
}

void Receive(kv::KvReceiver* receiver, std::vector<v1::KvChunk>* stream) {
  if (stream->empty()) return;
  size_t next = 0;
  absl::StatusOr<v1::KvAck> ack = kv::ReceiveKvStream(
      receiver,
      [&](v1::KvChunk* chunk) {
        if (next >= stream->size()) return false;
        *chunk = (*stream)[next++];
        return true;
      },
      [] { return false; });
  CheckStatus(ack.status());
  if (ack.ok()) Check(ack->blocks() >= 0 && ack->bytes() >= 0, "negative ack");
  stream->clear();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  kv::BlockPool& pool = SharedPool();
  const kv::KvLayout& layout = pool.layout();
  {
    kv::KvReceiver receiver(&pool, kMaxTokens);
    std::vector<v1::KvChunk> stream;
    size_t pos = 0;
    while (pos + 3 <= size) {
      const uint8_t tag = data[pos];
      const size_t len = std::min<size_t>(data[pos + 1] | (size_t(data[pos + 2]) << 8),
                                          size - pos - 3);
      const std::string bytes(reinterpret_cast<const char*>(data + pos + 3), len);
      pos += 3 + len;
      v1::KvChunk chunk;
      switch (tag & 7) {
        case 0:
          if (!chunk.mutable_header()->ParseFromString(bytes)) continue;
          stream.push_back(std::move(chunk));
          break;
        case 1: {
          v1::KvBlockPayload* b = chunk.mutable_block();
          if (!b->ParseFromString(bytes)) continue;
          if (tag & 0x40) {
            b->mutable_data()->resize(layout.BlockBytes(b->sliding() ? kv::LayerKind::kSliding
                                                                     : kv::LayerKind::kFull));
          }
          if (tag & 0x80) b->set_checksum(dgserve::Fnv1a64(b->data()));
          stream.push_back(std::move(chunk));
          break;
        }
        case 2:
          if (!chunk.mutable_trailer()->ParseFromString(bytes)) continue;
          stream.push_back(std::move(chunk));
          break;
        case 3:
          if (!chunk.ParseFromString(bytes)) continue;
          stream.push_back(std::move(chunk));
          break;
        case 4:
          Receive(&receiver, &stream);
          break;
        case 5:
          Receive(&receiver, &stream);
          receiver.Expect(bytes, absl::Now() + absl::Seconds(1),
                          [](absl::StatusOr<std::unique_ptr<kv::PagedKvCache>> r) {
                            if (r.ok()) {
                              Check(*r != nullptr, "null KV delivered");
                              Check((*r)->num_tokens() >= 0 && (*r)->num_tokens() <= kMaxTokens,
                                    "delivered KV beyond max_tokens");
                            } else {
                              CheckStatus(r.status());
                            }
                          });
          break;
        case 6:
          Receive(&receiver, &stream);
          receiver.Forget(bytes);
          break;
        case 7:
          Receive(&receiver, &stream);
          receiver.ReapExpired(absl::Now() + absl::Seconds(len));
          break;
      }
    }
    Receive(&receiver, &stream);
    Check(receiver.pending_transfers() == 0, "a transfer is still pending after its stream ended");
  }
  const kv::PoolStats stats = pool.stats();
  Check(stats.used[0] == 0 && stats.used[1] == 0, "blocks still referenced after the receiver");
  return 0;
}
