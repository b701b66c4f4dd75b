// The client end of one KvTransferService.PushBlocks stream (not part of the public interface):
// the TCP transport's byte mover sends whole blocks over it, the GPU transports only each
// block's control message (kind, index, size, checksum).
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "dgserve/v1/worker.grpc.pb.h"
#include "grpcpp/grpcpp.h"

namespace dgserve::kv::internal {

// gRPC status → absl status with the same code and a message naming the request and target.
absl::Status FromGrpc(const grpc::Status& s, const std::string& request_id,
                      const std::string& target);

class KvStreamClient {
 public:
  // `write_through`: every write reaches the socket before the next (the fault hook's cut then
  // lands mid-stream as on a real network).
  KvStreamClient(std::shared_ptr<grpc::Channel> channel, std::string target,
                 std::string request_id, bool write_through = false);
  ~KvStreamClient();  // cancels a stream that was not closed

  // Opens the stream with `deadline` (the lease) and writes the header.
  absl::Status Open(const v1::KvTransferHeader& header, absl::Time deadline);
  // One chunk. A stream the server closed: the server's status (through Finish).
  absl::Status Write(const v1::KvChunk& chunk);
  // Writes `chunk` and then cancels the call (the TCP fault hook).
  void WriteAndCut(const v1::KvChunk& chunk);
  // Writes the trailer, half-closes, returns the acknowledgement or the server's error.
  absl::StatusOr<v1::KvAck> Close(const v1::KvTransferTrailer& trailer);
  // Half-closes without a trailer and returns the server's status (the server ends a failed
  // transfer's stream itself; the call's deadline bounds the wait).
  absl::StatusOr<v1::KvAck> HalfCloseAndFinish();
  // Cancels the call (the server aborts the transfer). Idempotent.
  void Cancel();

 private:
  absl::Status Finish();

  std::shared_ptr<grpc::Channel> channel_;
  const std::string target_, request_id_;
  grpc::WriteOptions write_options_;
  std::unique_ptr<v1::KvTransferService::Stub> stub_;
  grpc::ClientContext context_;
  v1::KvAck ack_;
  std::unique_ptr<grpc::ClientWriter<v1::KvChunk>> writer_;
  bool finished_ = false;
  absl::Status finish_status_;
};

}  // namespace dgserve::kv::internal
