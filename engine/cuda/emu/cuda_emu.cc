// The scheduler and runtime behind cuda_emu.h: fibers (one per CUDA thread of the running
// block), the collectives that switch between them, and host memory standing in for the device.
#include "engine/cuda/emu/cuda_emu.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#if !defined(__x86_64__) || defined(DGSERVE_EMU_FORCE_UCONTEXT)
#include <ucontext.h>
#endif

namespace dgserve::cuda::emu {
namespace {

constexpr int kMaxThreadsPerBlock = 1024;
constexpr size_t kDefaultSharedBytes = 48 * 1024;
constexpr int kOptInSharedBytes = 232448;  // H100/H200: 227 KiB per block
constexpr size_t kStackBytes = 128 * 1024;

// ---- Execution contexts --------------------------------------------------------------------
// x86-64: a hand-written switch (swapcontext makes a system call per switch, about 10x slower).
// Elsewhere, or with -DDGSERVE_EMU_FORCE_UCONTEXT (to test that path on x86-64): ucontext.
#if defined(__x86_64__) && !defined(DGSERVE_EMU_FORCE_UCONTEXT)
// A minimal System V x86-64 switch: push the callee-saved registers, swap stack pointers, pop.
struct Context {
  void* sp = nullptr;
};
extern "C" void dgserve_emu_switch(void** save_sp, void* next_sp);
asm(R"(
  .text
  .globl dgserve_emu_switch
  .type dgserve_emu_switch, @function
dgserve_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size dgserve_emu_switch, .-dgserve_emu_switch
)");
void Switch(Context& from, Context& to) { dgserve_emu_switch(&from.sp, to.sp); }
// A fresh context that starts in entry() (which must never return) on [stack, stack + bytes).
void InitContext(Context& c, char* stack, size_t bytes, void (*entry)()) {
  auto top = reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t(15);
  auto* frame = reinterpret_cast<void**>(top);
  frame[-1] = nullptr;                               // entry()'s return address: never used
  frame[-2] = reinterpret_cast<void*>(entry);        // popped by `ret`
  for (int i = 3; i <= 8; ++i) frame[-i] = nullptr;  // the six callee-saved registers
  c.sp = frame - 8;
}
#else  // ucontext
struct Context {
  ucontext_t uc;
};
void Switch(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
void InitContext(Context& c, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

// ---- The running block -------------------------------------------------------------------------

enum class State { kRunnable, kWaitWarp, kWaitBlock, kDone };

// A cp.async issued and not yet completed by a wait (CpAsync below).
struct PendingCopy {
  void* dst;
  const void* src;
  size_t bytes;
};

struct Fiber {
  Context ctx;
  char* stack = nullptr;
  uint3 tid;
  State state = State::kRunnable;
  uint64_t result = 0;
  std::vector<PendingCopy> copies;  // issued cp.async, oldest first
  std::vector<size_t> groups;       // committed groups: each one's end in `copies`
};

struct Warp {
  unsigned live = 0;     // lanes that have not exited
  unsigned arrived = 0;  // lanes waiting at the pending collective
  unsigned mask = 0;     // the pending collective's mask and op
  WarpOp op = WarpOp::kSync;
  uint64_t in[32] = {};
  int arg[32] = {};
  // kExchange: the instruction, its function and every lane's operands.
  const char* name = nullptr;
  WarpExchangeFn fn = nullptr;
  const void* xin[32] = {};
  void* xout[32] = {};
};

struct Block {
  std::vector<Fiber> fibers;
  std::vector<Warp> warps;
  int live = 0, arrived = 0, count = 0;  // the block collective
  int current = -1;
  Context scheduler;
  std::string error;  // set on a failure: the scheduler abandons the block
  const std::function<void()>* body = nullptr;
  std::vector<unsigned char> shared;
};

Block* g_block = nullptr;  // the block being run (launches are serialised)

std::mutex g_launch_mu;
std::mutex g_state_mu;
cudaError_t g_last_error = cudaSuccess;    // cleared by cudaGetLastError
cudaError_t g_sticky_error = cudaSuccess;  // a failed kernel: reported by every later sync
std::map<const void*, int> g_max_dynamic_shared;

void SetLastError(cudaError_t e) {
  std::lock_guard<std::mutex> l(g_state_mu);
  g_last_error = e;
}

// Stacks are mapped once and reused by every launch; the lowest page of each is a guard page.
std::vector<char*>& StackPool() {
  static std::vector<char*> pool;
  return pool;
}
char* Stack(size_t i) {
  std::vector<char*>& pool = StackPool();
  while (pool.size() <= i) {
    void* p = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      std::perror("cuda_emu: mmap of a fiber stack");
      std::abort();
    }
    mprotect(p, size_t(sysconf(_SC_PAGESIZE)), PROT_NONE);
    pool.push_back(static_cast<char*>(p));
  }
  return pool[i];
}

void Resume(Block& b, int next) {
  b.current = next;
  threadIdx = b.fibers[next].tid;
}

// Leaves the current fiber (which is waiting or done) for the next runnable one, or for the
// scheduler when none is left (every thread done, or a deadlock the scheduler reports).
void SwitchAway(Block& b) {
  const int n = int(b.fibers.size()), self = b.current;
  if (b.error.empty()) {
    for (int k = 1; k <= n; ++k) {
      const int j = (self + k) % n;
      if (b.fibers[j].state != State::kRunnable) continue;
      if (j == self) return;
      Resume(b, j);
      Switch(b.fibers[self].ctx, b.fibers[j].ctx);
      return;
    }
  }
  Switch(b.fibers[self].ctx, b.scheduler);  // never resumed
}

void Fail(Block& b, const std::string& what) {
  if (b.error.empty()) {
    const uint3 t = b.fibers[b.current].tid;
    b.error = what + " (block " + std::to_string(blockIdx.x) + "," + std::to_string(blockIdx.y) +
              "," + std::to_string(blockIdx.z) + ", thread " + std::to_string(t.x) + "," +
              std::to_string(t.y) + "," + std::to_string(t.z) + ")";
  }
  Switch(b.fibers[b.current].ctx, b.scheduler);  // never resumed
}

const char* OpName(WarpOp op) {
  switch (op) {
    case WarpOp::kShflIdx:
      return "__shfl_sync";
    case WarpOp::kShflXor:
      return "__shfl_xor_sync";
    case WarpOp::kShflUp:
      return "__shfl_up_sync";
    case WarpOp::kShflDown:
      return "__shfl_down_sync";
    case WarpOp::kBallot:
      return "__ballot_sync";
    case WarpOp::kAny:
      return "__any_sync";
    case WarpOp::kAll:
      return "__all_sync";
    case WarpOp::kSync:
      return "__syncwarp";
    case WarpOp::kExchange:
      return "a matrix-core instruction (mma.sync / ldmatrix)";
  }
  return "?";
}

// Every lane of w.mask has arrived: computes each lane's result and wakes the waiting lanes.
void CompleteWarp(Block& b, int warp) {
  Warp& w = b.warps[warp];
  if (w.op == WarpOp::kExchange) {
    for (int l = 0; l < 32; ++l) {
      if (!(w.mask >> l & 1u)) w.xin[l] = w.xout[l] = nullptr;
    }
    w.fn(w.xin, w.xout);  // may fail the launch (KernelFailure): never returns then
  }
  unsigned pred_bits = 0;
  for (int l = 0; l < 32; ++l) {
    if ((w.mask >> l & 1u) && w.in[l] != 0) pred_bits |= 1u << l;
  }
  for (int l = 0; l < 32; ++l) {
    if (!(w.mask >> l & 1u)) continue;
    const int src = w.arg[l];  // ShflSource's lane (the caller's own for the votes)
    if (src < 0 || src > 31 || !(w.mask >> src & 1u)) {
      Fail(b, std::string(OpName(w.op)) + " of lane " + std::to_string(l) + " reads lane " +
                  std::to_string(src) + ", outside the mask");
    }
    uint64_t r = 0;
    switch (w.op) {
      case WarpOp::kShflIdx:
      case WarpOp::kShflXor:
      case WarpOp::kShflUp:
      case WarpOp::kShflDown:
        r = w.in[src];
        break;
      case WarpOp::kBallot:
        r = pred_bits;
        break;
      case WarpOp::kAny:
        r = pred_bits != 0;
        break;
      case WarpOp::kAll:
        r = pred_bits == w.mask;
        break;
      case WarpOp::kSync:
      case WarpOp::kExchange:
        break;
    }
    Fiber& f = b.fibers[warp * 32 + l];
    f.result = r;
    if (f.state == State::kWaitWarp) f.state = State::kRunnable;
  }
  w.arrived = 0;
}

// Every live thread has arrived (the running one included, still kRunnable): wakes the others;
// each thread's result holds the count (low 32 bits) and the number of participants.
void CompleteBlock(Block& b) {
  const uint64_t r = uint64_t(b.count) | uint64_t(b.arrived) << 32;
  b.fibers[b.current].result = r;
  for (Fiber& f : b.fibers) {
    if (f.state == State::kWaitBlock) {
      f.state = State::kRunnable;
      f.result = r;
    }
  }
  b.arrived = 0;
  b.count = 0;
}

// Where every fiber starts: runs the kernel body, then retires the thread.
void FiberMain() {
  Block& b = *g_block;
  (*b.body)();
  const int self = b.current;
  Fiber& f = b.fibers[self];
  CpAsyncWait(-1);  // copies the thread never waited for still land (nobody may rely on them)
  f.state = State::kDone;
  Warp& w = b.warps[self / 32];
  w.live &= ~(1u << (self % 32));
  if (w.arrived != 0 && (w.mask >> (self % 32) & 1u)) {
    Fail(b, std::string("thread exited while lanes of its warp wait for it at ") +
                (w.op == WarpOp::kExchange ? w.name : OpName(w.op)));
  }
  --b.live;
  if (b.arrived > 0 && b.arrived == b.live) CompleteBlock(b);
  SwitchAway(b);
  std::abort();  // a finished fiber is never resumed
}

}  // namespace

void SetMaxDynamicShared(const void* kernel, int bytes) {
  std::lock_guard<std::mutex> l(g_state_mu);
  g_max_dynamic_shared[kernel] = bytes;
}

void* DynamicSharedBase() { return g_block->shared.data(); }

namespace {

// The collective of WarpCollective and WarpExchange (name, fn, in, out: kExchange only).
uint64_t ArriveAtWarp(WarpOp op, unsigned mask, uint64_t value, int src_lane, const char* name,
                      WarpExchangeFn fn, const void* in, void* out) {
  Block& b = *g_block;
  const int self = b.current, lane = self % 32;
  Warp& w = b.warps[self / 32];
  const std::string what = op == WarpOp::kExchange ? std::string(name) : OpName(op);
  if (!(mask >> lane & 1u)) Fail(b, what + " by a lane outside its mask");
  if ((mask & ~w.live) != 0) {
    Fail(b, what + ": the mask names lanes that have exited or do not exist");
  }
  if (w.arrived != 0 && (w.op != op || w.mask != mask || w.fn != fn)) {
    Fail(b, "lanes of one warp at different collectives: " + what + " while others wait at " +
                (w.op == WarpOp::kExchange ? std::string(w.name) : OpName(w.op)));
  }
  w.op = op;
  w.mask = mask;
  w.name = name;
  w.fn = fn;
  w.xin[lane] = in;
  w.xout[lane] = out;
  w.in[lane] = value;
  w.arg[lane] = op == WarpOp::kShflIdx || op == WarpOp::kShflXor || op == WarpOp::kShflUp ||
                        op == WarpOp::kShflDown
                    ? src_lane
                    : lane;
  w.arrived |= 1u << lane;
  if ((w.arrived & mask) == mask) {
    CompleteWarp(b, self / 32);
    return b.fibers[self].result;
  }
  b.fibers[self].state = State::kWaitWarp;
  SwitchAway(b);
  return b.fibers[self].result;
}

}  // namespace

uint64_t WarpCollective(WarpOp op, unsigned mask, uint64_t value, int src_lane) {
  return ArriveAtWarp(op, mask, value, src_lane, nullptr, nullptr, nullptr, nullptr);
}

void WarpExchange(const char* name, unsigned mask, WarpExchangeFn fn, const void* in, void* out) {
  ArriveAtWarp(WarpOp::kExchange, mask, 0, 0, name, fn, in, out);
}

void KernelFailure(const std::string& what) {
  Fail(*g_block, what);
  std::abort();  // Fail never returns
}

void CpAsync(void* dst, const void* src, size_t bytes) {
  if (reinterpret_cast<uintptr_t>(dst) % bytes != 0 ||
      reinterpret_cast<uintptr_t>(src) % bytes != 0) {
    Fail(*g_block, "cp.async of " + std::to_string(bytes) + " bytes: an address not aligned to " +
                       std::to_string(bytes));
  }
  Fiber& f = g_block->fibers[g_block->current];
  f.copies.push_back(PendingCopy{dst, src, bytes});
}

void CpAsyncCommit() {
  Fiber& f = g_block->fibers[g_block->current];
  f.groups.push_back(f.copies.size());
}

void CpAsyncWait(int pending_groups) {
  Fiber& f = g_block->fibers[g_block->current];
  size_t done = f.copies.size();  // wait_all: everything, committed or not
  if (pending_groups >= 0) {
    if (f.groups.size() <= size_t(pending_groups)) return;
    done = f.groups[f.groups.size() - 1 - size_t(pending_groups)];
  }
  for (size_t i = 0; i < done; ++i) {
    std::memcpy(f.copies[i].dst, f.copies[i].src, f.copies[i].bytes);
  }
  f.copies.erase(f.copies.begin(), f.copies.begin() + ptrdiff_t(done));
  std::vector<size_t> left;
  for (size_t end : f.groups) {
    if (end > done) left.push_back(end - done);
  }
  f.groups = std::move(left);
}

BlockVote BlockCollective(int pred) {
  Block& b = *g_block;
  const int self = b.current;
  ++b.arrived;
  b.count += pred != 0;
  if (b.arrived == b.live)
    CompleteBlock(b);
  else {
    b.fibers[self].state = State::kWaitBlock;
    SwitchAway(b);
  }
  const uint64_t r = b.fibers[self].result;
  return BlockVote{int(r & 0xffffffffu), int(r >> 32)};
}

void Launch(const void* kernel, dim3 grid, dim3 block, size_t shared_bytes,
            const std::function<void()>& thread_body) {
  std::lock_guard<std::mutex> launch_lock(g_launch_mu);
  const uint64_t threads = uint64_t(block.x) * block.y * block.z;
  if (threads == 0 || threads > kMaxThreadsPerBlock || grid.x == 0 || grid.y == 0 || grid.z == 0 ||
      grid.y > 65535 || grid.z > 65535) {
    std::fprintf(stderr, "cuda_emu: invalid launch configuration (grid %u,%u,%u block %u,%u,%u)\n",
                 grid.x, grid.y, grid.z, block.x, block.y, block.z);
    SetLastError(cudaErrorInvalidConfiguration);
    return;
  }
  int allowed = int(kDefaultSharedBytes);
  {
    std::lock_guard<std::mutex> l(g_state_mu);
    auto it = g_max_dynamic_shared.find(kernel);
    if (it != g_max_dynamic_shared.end()) allowed = std::min(it->second, kOptInSharedBytes);
  }
  if (shared_bytes > size_t(allowed)) {
    std::fprintf(stderr,
                 "cuda_emu: %zu bytes of dynamic shared memory, the kernel may use %d "
                 "(cudaFuncAttributeMaxDynamicSharedMemorySize)\n",
                 shared_bytes, allowed);
    SetLastError(cudaErrorInvalidValue);
    return;
  }

  Block b;
  b.body = &thread_body;
  b.fibers.resize(threads);
  b.warps.resize((threads + 31) / 32);
  b.shared.resize(shared_bytes + 16);
  for (size_t i = 0; i < threads; ++i) b.fibers[i].stack = Stack(i);
  g_block = &b;
  blockDim = block;
  gridDim = grid;
  for (unsigned z = 0; z < grid.z && b.error.empty(); ++z) {
    for (unsigned y = 0; y < grid.y && b.error.empty(); ++y) {
      for (unsigned x = 0; x < grid.x && b.error.empty(); ++x) {
        blockIdx = uint3{x, y, z};
        for (size_t i = 0; i < threads; ++i) {
          Fiber& f = b.fibers[i];
          f.tid = uint3{unsigned(i % block.x), unsigned(i / block.x % block.y),
                        unsigned(i / (uint64_t(block.x) * block.y))};
          f.state = State::kRunnable;
          f.copies.clear();
          f.groups.clear();
          InitContext(f.ctx, f.stack, kStackBytes, &FiberMain);
        }
        for (size_t w = 0; w < b.warps.size(); ++w) {
          const size_t lanes = std::min<size_t>(32, threads - 32 * w);
          b.warps[w] = Warp{};
          b.warps[w].live = lanes == 32 ? ~0u : (1u << lanes) - 1;
        }
        b.live = int(threads);
        b.arrived = b.count = 0;
        std::memset(b.shared.data(), 0xFF, b.shared.size());  // uninitialised shared memory
        Resume(b, 0);
        Switch(b.scheduler, b.fibers[0].ctx);
        if (b.error.empty() && b.live > 0) {
          int at_block = 0, at_warp = 0;
          for (const Fiber& f : b.fibers) {
            at_block += f.state == State::kWaitBlock;
            at_warp += f.state == State::kWaitWarp;
          }
          b.error = "deadlock in block " + std::to_string(x) + "," + std::to_string(y) + "," +
                    std::to_string(z) + ": " + std::to_string(at_block) +
                    " threads wait at __syncthreads, " + std::to_string(at_warp) +
                    " at a warp collective, " + std::to_string(threads - b.live) + " exited";
        }
      }
    }
  }
  g_block = nullptr;
  threadIdx = blockIdx = uint3{};
  if (!b.error.empty()) {
    std::fprintf(stderr, "cuda_emu: kernel failed: %s\n", b.error.c_str());
    std::lock_guard<std::mutex> l(g_state_mu);
    g_last_error = g_sticky_error = cudaErrorLaunchFailure;
  }
}

void LaunchOn(cudaStream_t stream, const void* kernel, dim3 grid, dim3 block, size_t shared_bytes,
              std::function<void()> thread_body) {
  const cudaError_t e = Enqueue(stream, [=, body = std::move(thread_body)] {
    Launch(kernel, grid, block, shared_bytes, body);
  });
  if (e != cudaSuccess) SetLastError(e);
}

cudaError_t StickyError() {
  std::lock_guard<std::mutex> l(g_state_mu);
  return g_sticky_error;
}

namespace {
// Device allocations and pinned host ranges: start → bytes. Never destroyed: cudaFree may run
// in static destructors.
std::mutex g_alloc_mu;
std::map<uintptr_t, size_t>& DeviceAllocs() {
  static auto& m = *new std::map<uintptr_t, size_t>;
  return m;
}
std::map<uintptr_t, size_t>& Pinned() {
  static auto& m = *new std::map<uintptr_t, size_t>;
  return m;
}

// Address ranges cuMemAddressReserve reserved (cuda_emu_vmm.cc): start → bytes (their mapped
// memory is counted by TakeDeviceMemory).
std::map<uintptr_t, size_t>& Reservations() {
  static auto& m = *new std::map<uintptr_t, size_t>;
  return m;
}

size_t g_device_limit = 0;  // SetDeviceMemoryLimit (0: none)
size_t g_device_in_use = 0;

void Remember(std::map<uintptr_t, size_t>& m, const void* p, size_t bytes) {
  std::lock_guard<std::mutex> l(g_alloc_mu);
  m[reinterpret_cast<uintptr_t>(p)] = bytes;
  if (&m == &DeviceAllocs()) g_device_in_use += bytes;
}
bool Forget(std::map<uintptr_t, size_t>& m, const void* p) {
  std::lock_guard<std::mutex> l(g_alloc_mu);
  const auto it = m.find(reinterpret_cast<uintptr_t>(p));
  if (it == m.end()) return false;
  if (&m == &DeviceAllocs()) g_device_in_use -= it->second;
  m.erase(it);
  return true;
}
// Whether `bytes` more device memory fit under the limit.
bool DeviceRoomFor(size_t bytes) {
  std::lock_guard<std::mutex> l(g_alloc_mu);
  return g_device_limit == 0 || g_device_in_use + bytes <= g_device_limit;
}
bool Within(const std::map<uintptr_t, size_t>& m, const void* p, size_t bytes) {
  std::lock_guard<std::mutex> l(g_alloc_mu);
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = m.upper_bound(a);
  if (it == m.begin()) return false;
  --it;
  return a + bytes <= it->first + std::max<size_t>(it->second, 1);
}
}  // namespace

void SetDeviceMemoryLimit(size_t bytes) {
  std::lock_guard<std::mutex> l(g_alloc_mu);
  g_device_limit = bytes;
}
void DeviceMemoryInfo(size_t* free_bytes, size_t* total_bytes) {
  std::lock_guard<std::mutex> l(g_alloc_mu);
  if (g_device_limit == 0) {
    *total_bytes = size_t(141) << 30;  // as cudaGetDeviceProperties
    *free_bytes = *total_bytes;
    return;
  }
  *total_bytes = g_device_limit;
  *free_bytes = g_device_limit > g_device_in_use ? g_device_limit - g_device_in_use : 0;
}

bool IsPinnedHost(const void* p, size_t bytes) { return Within(Pinned(), p, bytes); }
bool IsDeviceMemory(const void* p, size_t bytes) {
  return Within(DeviceAllocs(), p, bytes) || Within(Reservations(), p, bytes);
}

bool TakeDeviceMemory(size_t bytes) {
  std::lock_guard<std::mutex> l(g_alloc_mu);
  if (g_device_limit != 0 && g_device_in_use + bytes > g_device_limit) return false;
  g_device_in_use += bytes;
  return true;
}
void GiveBackDeviceMemory(size_t bytes) {
  std::lock_guard<std::mutex> l(g_alloc_mu);
  g_device_in_use -= bytes;
}
void RememberReservation(const void* p, size_t bytes) { Remember(Reservations(), p, bytes); }
void ForgetReservation(const void* p) { Forget(Reservations(), p); }

}  // namespace dgserve::cuda::emu

// ---- Runtime API
// ---------------------------------------------------------------------------------

namespace {
using dgserve::cuda::emu::CaptureForbids;
using dgserve::cuda::emu::Enqueue;
using dgserve::cuda::emu::StickyError;

void* AlignedAlloc(size_t bytes) {
  return std::aligned_alloc(256, (std::max<size_t>(bytes, 1) + 255) / 256 * 256);
}

// Whether a copy of `kind` touches pageable host memory (the host side of a host↔device copy
// that is neither pinned nor a device allocation).
bool Pageable(const void* p, size_t bytes) {
  return !dgserve::cuda::emu::IsPinnedHost(p, bytes) &&
         !dgserve::cuda::emu::IsDeviceMemory(p, bytes);
}
bool TouchesPageable(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  switch (kind) {
    case cudaMemcpyHostToDevice:
      return Pageable(src, bytes);
    case cudaMemcpyDeviceToHost:
      return Pageable(dst, bytes);
    case cudaMemcpyHostToHost:
    case cudaMemcpyDefault:
      return Pageable(src, bytes) || Pageable(dst, bytes);
    case cudaMemcpyDeviceToDevice:
      return false;
  }
  return false;
}
}  // namespace

cudaError_t cudaMalloc(void** p, size_t bytes) {
  if (const cudaError_t e = CaptureForbids("cudaMalloc"); e != cudaSuccess) return e;
  // Over the limit (SetDeviceMemoryLimit) the call fails as CUDA's does: the error is also left
  // as the last error (cudaGetLastError).
  *p = dgserve::cuda::emu::DeviceRoomFor(bytes) ? AlignedAlloc(bytes) : nullptr;
  if (*p == nullptr) {
    dgserve::cuda::emu::SetLastError(cudaErrorMemoryAllocation);
    return cudaErrorMemoryAllocation;
  }
  dgserve::cuda::emu::Remember(dgserve::cuda::emu::DeviceAllocs(), *p, bytes);
  return cudaSuccess;
}
cudaError_t cudaFree(void* p) {
  if (const cudaError_t e = CaptureForbids("cudaFree"); e != cudaSuccess) return e;
  if (p != nullptr) dgserve::cuda::emu::Forget(dgserve::cuda::emu::DeviceAllocs(), p);
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaMallocHost(void** p, size_t bytes) {
  if (const cudaError_t e = CaptureForbids("cudaMallocHost"); e != cudaSuccess) return e;
  *p = AlignedAlloc(bytes);
  if (*p == nullptr) return cudaErrorMemoryAllocation;
  dgserve::cuda::emu::Remember(dgserve::cuda::emu::Pinned(), *p, bytes);
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) { return cudaMallocHost(p, bytes); }
cudaError_t cudaFreeHost(void* p) {
  if (const cudaError_t e = CaptureForbids("cudaFreeHost"); e != cudaSuccess) return e;
  if (p != nullptr && !dgserve::cuda::emu::Forget(dgserve::cuda::emu::Pinned(), p)) {
    return cudaErrorInvalidValue;
  }
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaHostRegister(void* p, size_t bytes, unsigned) {
  if (const cudaError_t e = CaptureForbids("cudaHostRegister"); e != cudaSuccess) return e;
  if (p == nullptr || bytes == 0) return cudaErrorInvalidValue;
  dgserve::cuda::emu::Remember(dgserve::cuda::emu::Pinned(), p, bytes);
  return cudaSuccess;
}
cudaError_t cudaHostUnregister(void* p) {
  if (const cudaError_t e = CaptureForbids("cudaHostUnregister"); e != cudaSuccess) return e;
  return dgserve::cuda::emu::Forget(dgserve::cuda::emu::Pinned(), p) ? cudaSuccess
                                                                     : cudaErrorInvalidValue;
}
namespace dgserve::cuda::emu {
namespace {
std::atomic<uint64_t> g_gemms{0}, g_h2d{0}, g_d2h{0}, g_d2d{0};
}  // namespace
CallCounts ReadCallCounts() { return {g_gemms.load(), g_h2d.load(), g_d2h.load(), g_d2d.load()}; }
void CountGemmCall() { ++g_gemms; }
}  // namespace dgserve::cuda::emu

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  if (const cudaError_t e = CaptureForbids("cudaMemcpy"); e != cudaSuccess) return e;
  if (kind == cudaMemcpyHostToDevice) ++dgserve::cuda::emu::g_h2d;
  if (kind == cudaMemcpyDeviceToHost) ++dgserve::cuda::emu::g_d2h;
  if (kind == cudaMemcpyDeviceToDevice) ++dgserve::cuda::emu::g_d2d;
  if (bytes > 0) std::memmove(dst, src, bytes);
  return StickyError();
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  if (kind == cudaMemcpyHostToDevice) ++dgserve::cuda::emu::g_h2d;
  if (kind == cudaMemcpyDeviceToHost) ++dgserve::cuda::emu::g_d2h;
  if (kind == cudaMemcpyDeviceToDevice) ++dgserve::cuda::emu::g_d2d;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (stream != nullptr && bytes > 0 && TouchesPageable(dst, src, bytes, kind) &&
      cudaStreamIsCapturing(stream, &status) == cudaSuccess &&
      status != cudaStreamCaptureStatusNone) {
    return dgserve::cuda::emu::RefuseInCapture(stream, "cudaMemcpyAsync of pageable host memory");
  }
  if (const cudaError_t e = Enqueue(stream,
                                    [=] {
                                      if (bytes > 0) std::memmove(dst, src, bytes);
                                    });
      e != cudaSuccess) {
    return e;
  }
  return StickyError();
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) {
  if (const cudaError_t e = CaptureForbids("cudaMemset"); e != cudaSuccess) return e;
  if (bytes > 0) std::memset(p, value, bytes);
  return StickyError();
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream) {
  if (const cudaError_t e = Enqueue(stream,
                                    [=] {
                                      if (bytes > 0) std::memset(p, value, bytes);
                                    });
      e != cudaSuccess) {
    return e;
  }
  return StickyError();
}
cudaError_t cudaDeviceReset() {
  std::lock_guard<std::mutex> l(dgserve::cuda::emu::g_state_mu);
  dgserve::cuda::emu::g_last_error = dgserve::cuda::emu::g_sticky_error = cudaSuccess;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  if (const cudaError_t e = CaptureForbids("cudaDeviceSynchronize"); e != cudaSuccess) return e;
  return StickyError();
}
cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) { return device == 0 ? cudaSuccess : cudaErrorInvalidDevice; }
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  if (attr != cudaDevAttrMaxSharedMemoryPerBlockOptin) return cudaErrorInvalidValue;
  *value = dgserve::cuda::emu::kOptInSharedBytes;
  return cudaSuccess;
}
cudaError_t cudaGetLastError() {
  std::lock_guard<std::mutex> l(dgserve::cuda::emu::g_state_mu);
  return std::exchange(dgserve::cuda::emu::g_last_error, cudaSuccess);
}
cudaError_t cudaPeekAtLastError() {
  std::lock_guard<std::mutex> l(dgserve::cuda::emu::g_state_mu);
  return dgserve::cuda::emu::g_last_error;
}
const char* cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "no error (emulated)";
    case cudaErrorInvalidValue:
      return "invalid argument (emulated)";
    case cudaErrorMemoryAllocation:
      return "out of memory (emulated)";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument (emulated)";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal (emulated)";
    case cudaErrorNoDevice:
      return "no CUDA-capable device is detected (emulated)";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure (emulated; see stderr)";
    case cudaErrorNotReady:
      return "device not ready (emulated)";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle (emulated)";
    case cudaErrorIllegalState:
      return "the operation cannot be performed in the present state (emulated)";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing (emulated)";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture (emulated)";
    case cudaErrorStreamCaptureImplicit:
      return "operation would make the legacy stream depend on a capturing blocking stream "
             "(emulated)";
  }
  return "unknown error (emulated)";
}
