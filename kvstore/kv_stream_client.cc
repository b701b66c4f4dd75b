#include "kvstore/kv_stream_client.h"

#include <chrono>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace dgserve::kv::internal {

absl::Status FromGrpc(const grpc::Status& s, const std::string& request_id,
                      const std::string& target) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()),
                      absl::StrCat("KV transfer for ", request_id, " to ", target,
                                   " failed: ", s.error_message()));
}

KvStreamClient::KvStreamClient(std::shared_ptr<grpc::Channel> channel, std::string target,
                               std::string request_id, bool write_through)
    : channel_(std::move(channel)), target_(std::move(target)), request_id_(std::move(request_id)) {
  if (write_through) write_options_.set_write_through();
}

KvStreamClient::~KvStreamClient() { Cancel(); }

absl::Status KvStreamClient::Open(const v1::KvTransferHeader& header, absl::Time deadline) {
  stub_ = v1::KvTransferService::NewStub(channel_);
  if (deadline != absl::InfiniteFuture()) context_.set_deadline(absl::ToChronoTime(deadline));
  writer_ = stub_->PushBlocks(&context_, &ack_);
  v1::KvChunk chunk;
  *chunk.mutable_header() = header;
  return Write(chunk);
}

absl::Status KvStreamClient::Write(const v1::KvChunk& chunk) {
  if (finished_) return finish_status_;
  if (writer_->Write(chunk, write_options_)) return absl::OkStatus();
  absl::Status s = Finish();
  if (s.ok()) {
    s = absl::UnavailableError(absl::StrCat("KV transfer for ", request_id_, " to ", target_,
                                            ": stream closed early"));
    finish_status_ = s;
  }
  return s;
}

void KvStreamClient::WriteAndCut(const v1::KvChunk& chunk) {
  if (finished_) return;
  writer_->Write(chunk, write_options_);
  context_.TryCancel();
  (void)Finish();  // CANCELLED; the server sees the stream end without a trailer
}

absl::StatusOr<v1::KvAck> KvStreamClient::Close(const v1::KvTransferTrailer& trailer) {
  v1::KvChunk chunk;
  *chunk.mutable_trailer() = trailer;
  if (absl::Status s = Write(chunk); !s.ok()) return s;
  writer_->WritesDone();
  if (absl::Status s = Finish(); !s.ok()) return s;
  return ack_;
}

absl::StatusOr<v1::KvAck> KvStreamClient::HalfCloseAndFinish() {
  if (!finished_) writer_->WritesDone();
  if (absl::Status s = Finish(); !s.ok()) return s;
  return ack_;
}

void KvStreamClient::Cancel() {
  if (writer_ == nullptr || finished_) return;
  context_.TryCancel();
  (void)Finish();
}

absl::Status KvStreamClient::Finish() {
  if (!finished_) {
    finished_ = true;
    finish_status_ = FromGrpc(writer_->Finish(), request_id_, target_);
  }
  return finish_status_;
}

}  // namespace dgserve::kv::internal
