#include "kvstore/gpu_internal.h"

#include <unistd.h>

#include <atomic>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/hash.h"
#include "grpcpp/grpcpp.h"

namespace dgserve::kv::gpu {

absl::Status CudaStatus(cudaError_t e, const std::string& what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

std::string NewSenderIdentity() {
  static std::atomic<int> serial{0};
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  return absl::StrCat(host, ":", getpid(), ":", ++serial);
}

absl::Status PollUntil(const std::function<absl::StatusOr<bool>()>& poll, absl::Time deadline,
                       const std::function<bool()>& cancelled, const std::string& what) {
  while (true) {
    absl::StatusOr<bool> done = poll();
    if (!done.ok()) return done.status();
    if (*done) return absl::OkStatus();
    if (cancelled && cancelled()) return absl::CancelledError(absl::StrCat(what, ": cancelled"));
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(what, ": not done by its deadline"));
    }
    absl::SleepFor(absl::Microseconds(200));
  }
}

std::vector<bool> RoundEnds(const std::vector<int64_t>& block_bytes, int64_t staging_bytes) {
  std::vector<bool> end(block_bytes.size(), false);
  int64_t used = 0;
  for (size_t i = 0; i < block_bytes.size(); ++i) {
    used = AlignUp(used) + block_bytes[i];
    const bool next_fits =
        i + 1 < block_bytes.size() && AlignUp(used) + block_bytes[i + 1] <= staging_bytes;
    if (!next_fits) {
      end[i] = true;
      used = 0;
    }
  }
  return end;
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ != nullptr) (void)cudaFree(data_);
}

absl::Status DeviceBuffer::Allocate(int64_t bytes) {
  void* p = nullptr;
  if (absl::Status s = CudaStatus(cudaMalloc(&p, size_t(bytes)),
                                  absl::StrCat("cudaMalloc of ", bytes, " bytes of staging"));
      !s.ok()) {
    return s;
  }
  data_ = static_cast<char*>(p);
  size_ = bytes;
  return absl::OkStatus();
}

std::shared_ptr<grpc::Channel> Dial(const GpuTransportOptions& options,
                                    const std::string& target) {
  grpc::ChannelArguments args;
  return options.make_channel
             ? options.make_channel(target, args)
             : grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
}

GpuMover::GpuMover(std::shared_ptr<grpc::Channel> channel, const std::string& target,
                   const std::string& request_id, v1::KvDataPath path, std::string session,
                   int64_t staging_bytes)
    : target_(target),
      request_id_(request_id),
      stream_(std::move(channel), target, request_id),
      path_(path),
      session_(std::move(session)),
      staging_bytes_(staging_bytes) {}

absl::Status GpuMover::Open(const v1::KvTransferHeader& header,
                            const std::vector<internal::OutgoingBlock>& blocks,
                            absl::Time deadline) {
  deadline_ = deadline;
  blocks_ = &blocks;
  v1::KvTransferHeader h = header;
  h.set_data_path(path_);
  h.set_gpu_session(session_);
  round_end_.clear();
  return stream_.Open(h, deadline);
}

absl::Status GpuMover::MoveBlock(const PagedKvCache& kv, size_t index) {
  const internal::OutgoingBlock& b = (*blocks_)[index];
  const BlockPool* pool = kv.pool();
  if (round_end_.empty()) {
    std::vector<int64_t> sizes;
    for (const internal::OutgoingBlock& o : *blocks_) {
      sizes.push_back(int64_t(pool->layout().BlockBytes(o.kind)));
    }
    round_end_ = RoundEnds(sizes, staging_bytes_);
  }
  const int64_t bytes = int64_t(pool->layout().BlockBytes(b.kind));
  if (bytes > staging_bytes_) {
    Broken(absl::FailedPreconditionError("block larger than staging"));
    return absl::FailedPreconditionError(absl::StrCat(
        "a block of ", bytes, " bytes does not fit the ", staging_bytes_,
        " bytes of GPU staging memory (GpuTransportOptions::staging_bytes)"));
  }
  auto fail = [&](absl::Status s) {
    failed_ = true;
    Broken(s);
    return s;
  };
  if (offsets_.empty()) {
    if (absl::Status s = BeginRound(round_); !s.ok()) return fail(ReceiverStatus(s));
    next_offset_ = 0;
  }
  const void* host = pool->BlockData(b.kind, b.physical);
  const int64_t offset = AlignUp(next_offset_);
  if (absl::Status s = StageBlock(host, bytes, offset); !s.ok()) return fail(s);
  offsets_.push_back(offset);
  sizes_.push_back(bytes);
  next_offset_ = offset + bytes;

  v1::KvChunk chunk;
  v1::KvBlockPayload* p = chunk.mutable_block();
  p->set_sliding(b.kind == LayerKind::kSliding);
  p->set_logical_block(b.logical);
  p->set_out_of_band(true);
  p->set_data_bytes(bytes);
  p->set_checksum(Fnv1a64(std::string_view(static_cast<const char*>(host), size_t(bytes))));
  const bool end = round_end_[index];
  p->set_group_end(end);
  if (end && end_round_when() == When::kBeforeLastMessage) {
    if (absl::Status s = EndRound(offsets_, sizes_); !s.ok()) return fail(s);
  }
  if (absl::Status s = stream_.Write(chunk); !s.ok()) return fail(s);
  if (end) {
    if (end_round_when() == When::kAfterLastMessage) {
      if (absl::Status s = EndRound(offsets_, sizes_); !s.ok()) return fail(ReceiverStatus(s));
    }
    offsets_.clear();
    sizes_.clear();
    ++round_;
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::KvAck> GpuMover::Close(const v1::KvTransferTrailer& trailer) {
  absl::StatusOr<v1::KvAck> ack = stream_.Close(trailer);
  if (!ack.ok()) {
    failed_ = true;
    Broken(ack.status());
  }
  return ack;
}

void GpuMover::Cancel(const absl::Status& why) {
  if (!failed_) Broken(why);
  failed_ = true;
  stream_.Cancel();
}

absl::Status GpuMover::ReceiverStatus(const absl::Status& fallback) {
  absl::StatusOr<v1::KvAck> r = stream_.HalfCloseAndFinish();
  if (!r.ok() && r.status().code() != absl::StatusCode::kDeadlineExceeded) return r.status();
  return fallback;
}

absl::StatusOr<std::vector<int64_t>> RoundOffsets(const std::vector<v1::KvBlockPayload>& blocks,
                                                  int64_t staging_bytes) {
  std::vector<int64_t> offsets;
  offsets.reserve(blocks.size());
  int64_t end = 0;
  for (const v1::KvBlockPayload& b : blocks) {
    const int64_t off = AlignUp(end);
    if (b.data_bytes() <= 0 || off + b.data_bytes() > staging_bytes) {
      return absl::InvalidArgumentError(absl::StrCat(
          "staging round of ", blocks.size(), " blocks does not fit the ", staging_bytes,
          " bytes of staging (block ", b.logical_block(), ": ", b.data_bytes(), " bytes)"));
    }
    offsets.push_back(off);
    end = off + b.data_bytes();
  }
  return offsets;
}

absl::Status CopyRoundOut(std::vector<v1::KvBlockPayload>& blocks, const char* staging,
                          const std::vector<int64_t>& offsets, const std::string& what) {
  for (size_t i = 0; i < blocks.size(); ++i) {
    std::string* data = blocks[i].mutable_data();
    data->resize(size_t(blocks[i].data_bytes()));
    if (absl::Status e = CudaStatus(cudaMemcpy(data->data(), staging + offsets[i], data->size(),
                                               cudaMemcpyDeviceToHost),
                                    what);
        !e.ok()) {
      return e;
    }
  }
  return absl::OkStatus();
}

absl::Status CheckGpuTransportOptions(const std::string& what,
                                      const GpuTransportOptions& options) {
  if (options.cuda_device < 0) {
    return absl::UnavailableError(absl::StrCat(what, ": no CUDA device (cuda_device < 0)"));
  }
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || options.cuda_device >= count) {
    return absl::UnavailableError(
        absl::StrCat(what, ": CUDA device ", options.cuda_device, " is not usable"));
  }
  if (options.staging_bytes < kStagingAlign) {
    return absl::InvalidArgumentError("GpuTransportOptions::staging_bytes too small");
  }
  return absl::OkStatus();
}

}  // namespace dgserve::kv::gpu
