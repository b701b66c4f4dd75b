// What both workers load: the checkpoint, the backend --device names over it, and the paged KV
// pool sized from a memory budget.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "dgserve/v1/worker.pb.h"
#include "engine/model/backend.h"
#include "engine/model/backend_select.h"
#include "engine/model/checkpoint.h"
#include "kvstore/block_pool.h"
#include "service/server.h"

namespace dgserve {

struct WorkerModel {
  std::unique_ptr<Checkpoint> checkpoint;  // weights the backend reads (stable address)
  std::unique_ptr<ModelBackend> backend;
  std::unique_ptr<kv::BlockPool> pool;
  std::string model_id;
};

// Loads `dir` and builds the backend `backend` selects (CreateBackend: "cpu", or "cuda":
// FAILED_PRECONDITION when the binary was built without the CUDA backend or no GPU is present;
// another device is INVALID_ARGUMENT, checked before the load) and a block pool of `kv_cache_mib`
// MiB split evenly in blocks of both kinds (INVALID_ARGUMENT when it holds fewer blocks than one
// canvas needs).
absl::StatusOr<WorkerModel> LoadWorkerModel(const std::string& dir, const std::string& model_id,
                                            const BackendSelection& backend, int64_t kv_cache_mib,
                                            int kv_block_size);

// A block pool of `kv_cache_mib` MiB split evenly in blocks of both kinds. INVALID_ARGUMENT for
// a block size outside 1..1024, a budget ≤ 0, or one that holds fewer blocks than a canvas needs.
absl::StatusOr<std::unique_ptr<kv::BlockPool>> CreateKvPool(const ModelConfig& config,
                                                          const std::string& model_id,
                                                          int64_t kv_cache_mib,
                                                          int kv_block_size);

// Fills the KV pool part of a Stats reply (blocks by kind and state, prefix-cache counters).
void FillPoolStats(const kv::BlockPool& pool, v1::StatsResponse* response);

}  // namespace dgserve
