#include "worker/worker_model.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kvstore/transfer.h"

namespace dgserve {

absl::StatusOr<std::unique_ptr<kv::BlockPool>> CreateKvPool(const ModelConfig& config,
                                                          const std::string& model_id,
                                                          int64_t kv_cache_mib,
                                                          int kv_block_size) {
  if (kv_block_size <= 0 || kv_block_size > 1024) {
    return absl::InvalidArgumentError("--kv_block_size: must be in 1..1024");
  }
  if (kv_cache_mib <= 0) return absl::InvalidArgumentError("--kv_cache_mib: must be > 0");
  const kv::KvLayout layout = kv::KvLayout::FromConfig(config, kv_block_size,
                                                       model_id);
  const size_t per_pair =
      layout.BlockBytes(kv::LayerKind::kSliding) + layout.BlockBytes(kv::LayerKind::kFull);
  const int64_t blocks = int64_t((kv_cache_mib << 20) / int64_t(per_pair));
  const int canvas_blocks = layout.BlocksFor(config.canvas_length) + 1;
  if (blocks < 2 * canvas_blocks) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_cache_mib ", kv_cache_mib, " holds ", blocks, " blocks of ", kv_block_size,
        " tokens; at least ", 2 * canvas_blocks, " are needed for one canvas"));
  }
  return kv::BlockPool::Create(layout, blocks, blocks);
}

absl::StatusOr<WorkerModel> LoadWorkerModel(const std::string& dir, const std::string& model_id,
                                            const BackendSelection& backend, int64_t kv_cache_mib,
                                            int kv_block_size) {
  // Before the (slow) checkpoint load.
  if (absl::Status st = CheckBackendSelection(backend); !st.ok()) return st;
  if (kv_block_size <= 0 || kv_block_size > 1024) {
    return absl::InvalidArgumentError("--kv_block_size: must be in 1..1024");
  }
  if (kv_cache_mib <= 0) return absl::InvalidArgumentError("--kv_cache_mib: must be > 0");
  WorkerModel m;
  m.model_id = model_id;
  DGSERVE_ASSIGN_OR_RETURN(Checkpoint ckpt, LoadCheckpoint(dir));
  m.checkpoint = std::make_unique<Checkpoint>(std::move(ckpt));
  DGSERVE_ASSIGN_OR_RETURN(m.backend,
                           CreateBackend(backend, m.checkpoint->config, m.checkpoint->weights));
  DGSERVE_ASSIGN_OR_RETURN(m.pool, CreateKvPool(m.checkpoint->config, model_id, kv_cache_mib,
                                                kv_block_size));
  return m;
}

void FillPoolStats(const kv::BlockPool& pool, v1::StatsResponse* response) {
  const kv::PoolStats s = pool.stats();
  const int sl = kv::KindIndex(kv::LayerKind::kSliding), fu = kv::KindIndex(kv::LayerKind::kFull);
  v1::KvPoolStats* k = response->mutable_kv();
  k->set_sliding_blocks_total(s.total[sl]);
  k->set_sliding_blocks_used(s.used[sl]);
  k->set_sliding_blocks_cached(s.cached[sl]);
  k->set_full_blocks_total(s.total[fu]);
  k->set_full_blocks_used(s.used[fu]);
  k->set_full_blocks_cached(s.cached[fu]);
  k->set_sliding_blocks_shared(s.shared[sl]);
  k->set_full_blocks_shared(s.shared[fu]);
  k->set_block_size(pool.layout().block_size);
  *response->mutable_kv_layout() = kv::DescribeLayout(pool.layout());
  response->set_prefix_cache_hit_tokens(s.prefix_hit_tokens);
  response->set_prefix_cache_queries(s.prefix_queries);
}

}  // namespace dgserve
