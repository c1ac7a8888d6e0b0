/*
 * sim_runtime.cpp: the CPU stand-in for the CUDA runtime (tests only; see
 * docs/gpu.md, "The CPU stand-in", and include/zt_sim.h).
 *
 * Layout of this file: settings and global state; device memory (guard
 * pages, poison, canaries, host-access protection, quarantine of freed
 * memory); the fault handler; the scheduler (blocks, fibers, barriers, warp
 * exchanges, shared memory); the runtime API.
 *
 * Everything the stand-in finds wrong that a GPU would report as a fault or
 * a hang (an access past an allocation, a deadlocked barrier, a host
 * pointer given to a kernel, host code reading device memory) ends the
 * process with a line that starts "zt-sim:" and names the kernel, the
 * block and the thread. Errors the CUDA runtime returns (bad launch
 * configuration, out of memory, bad device index, bad copy) are returned
 * with the real codes and kept for cudaGetLastError.
 */
#include <errno.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <ucontext.h>
#include <unistd.h>

#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "zt_sim.h"

__thread uint3 threadIdx;
__thread uint3 blockIdx;
__thread uint3 blockDim;
__thread uint3 gridDim;

namespace zt_sim {

/* ---------------------------------------------------------------------------
 * Settings (environment, read once) and state. */

namespace {

const size_t kPage = 4096;
const size_t kAlign = 256;           /* cudaMalloc's alignment */
const size_t kStaticShared = 48 << 10; /* per block, as on the GPU without opt-in */
const unsigned char kPoison = 0xff; /* fresh device memory, shared memory: NaN */
/* Pad and slack: the bytes of the float 0xffa0a5a5, a signalling NaN, by
 * address mod 4. Read as floats they are NaN; arithmetic on them gives a
 * quiet NaN, another bit pattern, so a kernel that computes from a value
 * past the end and stores past the end is caught too (with plain 0xff
 * bytes it would store the canary back). */
const unsigned char kCanary[4] = {0xa5, 0xa5, 0xa0, 0xff};

struct settings {
  uint64_t seed = 1;
  int devices = 1;
  size_t memory = (size_t)16 << 30;
  bool all_fibers = false;
  bool host_access = false;
  size_t stack = 64 << 10;
};

std::recursive_mutex g_mu;
bool g_init;
settings g_set;
uint64_t g_launches;

__thread cudaError_t t_last_error;
__thread int t_device;

void init_locked() {
  if (g_init) return;
  g_init = true;
  const char *e;
  if ((e = getenv("ZT_SIM_SEED")) && *e) g_set.seed = strtoull(e, NULL, 0);
  if ((e = getenv("ZT_SIM_DEVICE_COUNT")) && *e) g_set.devices = atoi(e);
  if ((e = getenv("ZT_SIM_MEMORY_MB")) && *e) g_set.memory = (size_t)strtoull(e, NULL, 0) << 20;
  if ((e = getenv("ZT_SIM_FIBERS")) && !strcmp(e, "all")) g_set.all_fibers = true;
  if ((e = getenv("ZT_SIM_HOST_ACCESS")) && !strcmp(e, "1")) g_set.host_access = true;
  if ((e = getenv("ZT_SIM_STACK_KB")) && *e) g_set.stack = (size_t)strtoull(e, NULL, 0) << 10;
  g_set.stack = (g_set.stack + kPage - 1) & ~(kPage - 1);
  if (g_set.stack < 16 * kPage) g_set.stack = 16 * kPage;
  fprintf(stderr,
          "zt-sim: CUDA stand-in on the CPU: seed %llu (ZT_SIM_SEED), %d device(s), %zu MiB%s%s\n",
          (unsigned long long)g_set.seed, g_set.devices, g_set.memory >> 20,
          g_set.all_fibers ? ", every kernel on fibers" : "",
          g_set.host_access ? ", host access to device memory allowed" : "");
}

uint64_t splitmix(uint64_t *s) {
  uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

cudaError_t set_error(cudaError_t e) {
  if (e != cudaSuccess) t_last_error = e;
  return e;
}

/* What the calling thread is doing on the "device", for fault reports. */
struct op_state {
  const char *what;   /* "kernel", "cublasLtMatmul", ... or NULL */
  const char *kernel; /* name of the running kernel */
  uint3 block, thread;
  int in_thread; /* a kernel thread is running (block/thread valid) */
};
__thread op_state t_op;

}  // namespace

void fatal(const char *fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  fprintf(stderr, "zt-sim: %s\n", buf);
  fflush(stderr);
  abort();
}

/* ---------------------------------------------------------------------------
 * Device memory. Each allocation is its own mapping:
 *
 *   [guard page][pad][data: size bytes][slack][guard page]
 *
 * data starts 256-byte aligned (as cudaMalloc's) and data + slack ends at
 * the guard page (slack < 256 bytes), so reading or writing past the end
 * faults unless it stays in the slack; pad and slack hold a canary
 * (kCanary) that is checked after every piece of device work (a write into
 * them is reported with the kernel that did it) and reads as NaN. Fresh
 * memory is 0xff bytes (NaN), as is shared memory at each block's start, so
 * a kernel that reads what nobody wrote computes NaN. Outside device work
 * the data pages are PROT_NONE, so host code that dereferences a device
 * pointer faults (ZT_SIM_HOST_ACCESS=1 allows it). Freed allocations stay mapped PROT_NONE for a while (quarantine),
 * so a use after cudaFree faults and is named as such. */

namespace {

struct alloc_t {
  char *map;
  size_t maplen;
  char *p;
  size_t size;
  size_t span; /* size rounded up to kAlign */
};

std::map<uintptr_t, alloc_t> g_allocs; /* live, keyed by p */
std::deque<alloc_t> g_freed;            /* quarantine, oldest first */
size_t g_freed_bytes;
size_t g_used;
int g_access_depth;
const char *g_access_what;
const size_t kQuarantine = (size_t)4 << 30; /* address space, and mappings: */
const size_t kQuarantineCount = 4096;         /* well under vm.max_map_count */

unsigned char g_canary_page[kPage]; /* kCanary from a page-aligned address */

inline unsigned char canary_at(const void *q) { return kCanary[(uintptr_t)q & 3]; }

void fill_canary(char *q, size_t n) {
  for (size_t i = 0; i < n; i++) q[i] = (char)canary_at(q + i);
}

char *data_begin(const alloc_t &a) { return a.map + kPage; }
size_t data_len(const alloc_t &a) { return a.maplen - 2 * kPage; }

/* The live allocation whose mapping holds p (guard pages and pad
 * included), or NULL. The map is keyed by the data's start, which lies
 * after the guard page and pad: an address in those belongs to the first
 * allocation whose key is above it. */
const alloc_t *find_live(const void *p) {
  uintptr_t x = (uintptr_t)p;
  auto it = g_allocs.upper_bound(x);
  if (it != g_allocs.end() && x >= (uintptr_t)it->second.map) return &it->second;
  if (it == g_allocs.begin()) return NULL;
  --it;
  const alloc_t &a = it->second;
  return x < (uintptr_t)a.map + a.maplen ? &a : NULL;
}

const alloc_t *find_freed(const void *p) {
  uintptr_t x = (uintptr_t)p;
  for (auto &a : g_freed)
    if (x >= (uintptr_t)a.map && x < (uintptr_t)a.map + a.maplen) return &a;
  return NULL;
}

void protect(const alloc_t &a, int prot) {
  if (mprotect(data_begin(a), data_len(a), prot) != 0)
    fatal("mprotect of device memory failed: %s", strerror(errno));
}

/* The first byte of pad or slack that is not the canary, or NULL. */
const char *damaged(const alloc_t &a) {
  const char *pad = data_begin(a), *slack = a.p + a.size, *end = a.p + a.span;
  for (const char *q = pad; q < a.p; q += kPage) {
    size_t n = (size_t)(a.p - q) < kPage ? (size_t)(a.p - q) : kPage;
    if (memcmp(q, g_canary_page, n) != 0)
      for (size_t i = 0; i < n; i++)
        if ((unsigned char)q[i] != canary_at(q + i)) return q + i;
  }
  for (const char *q = slack; q < end; q++)
    if ((unsigned char)*q != canary_at(q)) return q;
  return NULL;
}

void check_canaries(const char *what) {
  for (auto &kv : g_allocs) {
    const alloc_t &a = kv.second;
    const char *bad = damaged(a);
    if (!bad) continue;
    if (bad >= a.p)
      fatal("%s wrote past the end of a device allocation: byte %zu after the end of %zu "
            "bytes at %p",
            what, (size_t)(bad - (a.p + a.size)), a.size, (void *)a.p);
    fatal("%s wrote before the start of a device allocation: %zu bytes before %zu bytes at %p",
          what, (size_t)(a.p - bad), a.size, (void *)a.p);
  }
}

}  // namespace

device_access::device_access(const char *what) {
  g_mu.lock();
  if (g_access_depth++ == 0) {
    g_access_what = what;
    if (!g_set.host_access)
      for (auto &kv : g_allocs) protect(kv.second, PROT_READ | PROT_WRITE);
  }
}

device_access::~device_access() {
  if (--g_access_depth == 0) {
    check_canaries(g_access_what);
    if (!g_set.host_access)
      for (auto &kv : g_allocs) protect(kv.second, PROT_NONE);
    g_access_what = NULL;
  }
  g_mu.unlock();
}

int in_device_memory(const void *p, size_t bytes) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  const alloc_t *a = find_live(p);
  return a && (const char *)p >= a->p && (size_t)((const char *)p - a->p) <= a->size &&
         bytes <= a->size - (size_t)((const char *)p - a->p);
}

void require_device_memory(const void *p, size_t bytes, const char *what) {
  if (in_device_memory(p, bytes)) return;
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  const alloc_t *a = find_live(p);
  if (a && (const char *)p < a->p)
    fatal("%s: %p lies %zu bytes before the %zu-byte device allocation at %p", what, p,
          (size_t)(a->p - (const char *)p), a->size, (void *)a->p);
  if (a)
    fatal("%s: %zu bytes at %p run past the end of the %zu-byte device allocation at %p", what,
          bytes, p, a->size, (void *)a->p);
  if (find_freed(p)) fatal("%s: %p is device memory that was freed (use after cudaFree)", what, p);
  fatal("%s: %p is not device memory (a host pointer?)", what, p);
}

/* ---------------------------------------------------------------------------
 * Faults. SIGSEGV and SIGBUS print what was running and where the address
 * lies, then abort. The handler runs on an alternate stack (a fiber's stack
 * overflow lands in its guard page). */

namespace {

struct stack_slot {
  char *map; /* guard page at map, stack above it */
  size_t len;
};
std::vector<stack_slot> g_stacks;

void describe_address(char *buf, size_t len, const void *addr) {
  uintptr_t x = (uintptr_t)addr;
  const alloc_t *a = find_live(addr);
  if (a) {
    if (x >= (uintptr_t)a->p + a->span)
      snprintf(buf, len, "%zu bytes past the end of the %zu-byte device allocation at %p",
               (size_t)(x - ((uintptr_t)a->p + a->size)), a->size, (void *)a->p);
    else if (x < (uintptr_t)data_begin(*a))
      snprintf(buf, len, "%zu bytes before the %zu-byte device allocation at %p",
               (size_t)((uintptr_t)a->p - x), a->size, (void *)a->p);
    else
      snprintf(buf, len,
               "inside the %zu-byte device allocation at %p, which host code may not touch "
               "(device memory is reachable only through CUDA calls and kernels; "
               "ZT_SIM_HOST_ACCESS=1 allows it)",
               a->size, (void *)a->p);
    return;
  }
  if ((a = find_freed(addr))) {
    snprintf(buf, len, "in the %zu-byte device allocation at %p, freed (use after cudaFree)",
             a->size, (void *)a->p);
    return;
  }
  for (auto &s : g_stacks)
    if (x >= (uintptr_t)s.map && x < (uintptr_t)s.map + kPage) {
      snprintf(buf, len, "in the guard page of a fiber stack: stack overflow (ZT_SIM_STACK_KB)");
      return;
    }
  snprintf(buf, len, "not device memory");
}

void on_fault(int sig, siginfo_t *si, void *) {
  char where[512], buf[1400];
  describe_address(where, sizeof where, si->si_addr);
  const op_state &o = t_op;
  if (o.what && o.in_thread)
    snprintf(buf, sizeof buf,
             "zt-sim: %s in kernel %s, block (%u,%u,%u), thread (%u,%u,%u): address %p: %s\n",
             sig == SIGBUS ? "bus error" : "segmentation fault", o.kernel, o.block.x, o.block.y,
             o.block.z, o.thread.x, o.thread.y, o.thread.z, si->si_addr, where);
  else if (g_access_depth > 0 && g_access_what)
    snprintf(buf, sizeof buf, "zt-sim: %s in %s: address %p: %s\n",
             sig == SIGBUS ? "bus error" : "segmentation fault", g_access_what, si->si_addr, where);
  else
    snprintf(buf, sizeof buf, "zt-sim: %s in host code: address %p: %s\n",
             sig == SIGBUS ? "bus error" : "segmentation fault", si->si_addr, where);
  ssize_t w = write(2, buf, strlen(buf));
  (void)w;
  signal(SIGABRT, SIG_DFL);
  abort();
}

__thread bool t_altstack;

void install_fault_handler() {
  static bool installed;
  if (!t_altstack) {
    /* The alternate stack of this thread (kept for the thread's life). */
    stack_t ss;
    ss.ss_size = 64 << 10;
    ss.ss_sp = mmap(NULL, ss.ss_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    ss.ss_flags = 0;
    if (ss.ss_sp != MAP_FAILED) sigaltstack(&ss, NULL);
    t_altstack = true;
  }
  if (installed) return;
  installed = true;
  for (size_t i = 0; i < kPage; i++) g_canary_page[i] = kCanary[i & 3];
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
}

void ensure_init() {
  init_locked();
  install_fault_handler();
}

}  // namespace

/* ---------------------------------------------------------------------------
 * The scheduler. One launch runs its blocks one after the other, in an
 * order drawn from the seed. A block's threads either run one after the
 * other in a random order (kernels with no barrier) or each on a fiber
 * (ucontext): the scheduler picks a random runnable fiber and runs it until
 * it reaches a barrier or returns. __syncthreads releases the block's
 * fibers when all of them have arrived; a warp operation stores the lane's
 * value in the warp's exchange area and waits; when every lane of its mask
 * that has not returned has stored (CUDA asks that of the non-exited lanes
 * only), they are released with one copy of the values of the mask's lanes,
 * kept until each has read it (so a fast lane's next operation cannot
 * overwrite a value a slow lane has yet to read), and the area's slots go
 * back to 0xff. Operations with different masks are gathered apart, so
 * lanes may wait at one while others finish another first. When no fiber
 * can run and some have not returned, the block is deadlocked: a thread
 * returned without reaching a barrier that others wait at (or lanes wait
 * for each other at warp operations); the stand-in says which and stops. */

/* Switching fibers. glibc's swapcontext saves and restores the signal mask
 * with a system call on every switch, which made a training step of the
 * gpu-sim worker tests take seconds; on x86-64 a switch is instead the
 * twelve instructions below (callee-saved registers, MXCSR and the x87
 * control word, as Boost.Context's fcontext does), and a new fiber starts
 * from a frame laid out by hand (fiber_stack). Elsewhere ucontext is used.
 * The switch returns into another stack, which a CET shadow stack would
 * refuse; Linux enables those only for programs that ask for them, and
 * these test programs do not. */
#if defined(__x86_64__)
#define ZT_SIM_FAST_SWITCH 1
extern "C" void zt_sim_switch(void **save_sp, void *load_sp);
__asm__(
    ".pushsection .text\n"
    ".globl zt_sim_switch\n"
    ".hidden zt_sim_switch\n"
    ".type zt_sim_switch,@function\n"
    "zt_sim_switch:\n"
    "  pushq %rbp\n"
    "  pushq %rbx\n"
    "  pushq %r12\n"
    "  pushq %r13\n"
    "  pushq %r14\n"
    "  pushq %r15\n"
    "  subq $8, %rsp\n"
    "  stmxcsr (%rsp)\n"
    "  fnstcw 4(%rsp)\n"
    "  movq %rsp, (%rdi)\n"
    "  movq %rsi, %rsp\n"
    "  ldmxcsr (%rsp)\n"
    "  fldcw 4(%rsp)\n"
    "  addq $8, %rsp\n"
    "  popq %r15\n"
    "  popq %r14\n"
    "  popq %r13\n"
    "  popq %r12\n"
    "  popq %rbx\n"
    "  popq %rbp\n"
    "  ret\n"
    ".size zt_sim_switch, .-zt_sim_switch\n"
    ".popsection\n");
#endif

namespace {

enum fiber_state { F_RUN, F_BAR, F_WARP, F_DONE };

typedef unsigned char warp_slots[32][16];

struct fiber_t {
  ucontext_t uc;
  void *sp; /* ZT_SIM_FAST_SWITCH: the stack pointer it was switched out at */
  uint3 tid;
  int warp, lane;
  fiber_state st;
  unsigned sync_rounds;
  int result; /* what its last warp operation gathered (launch_t::results), or -1 */
  int made;   /* uc initialised by getcontext */
};

/* A warp operation that lanes wait at: its mask and the lanes there. */
struct warp_op {
  unsigned mask, waiting;
};

struct warp_t {
  unsigned present;   /* lanes that exist */
  unsigned done;      /* lanes that returned */
  int npend;          /* pending operations (one per mask) */
  warp_op pend[32];
  warp_slots slots;   /* the values the waiting lanes stored */
};

/* The values a warp operation gathered, kept until each lane it released
 * has read them (its next warp operation, or its return). */
struct warp_result {
  warp_slots slots;
  int refs;
};

struct launch_t {
  const char *name;
  uint3 grid, block;
  size_t dyn_shmem;
  bool fibers;
  thread_body body;
  void *ctx;
  int nthreads;
  /* shared memory: layout found at first use, one arena reused by blocks */
  std::vector<std::pair<const void *, size_t>> shared_vars;
  size_t shared_used;
  /* block state (fiber mode) */
  int bar_arrived;
  int tally[3];
  fiber_t *cur;
  std::vector<int> runnable;
  std::vector<warp_t> warps;
  std::vector<warp_result> results;
  std::vector<int> free_results;
  ucontext_t sched;
  void *sched_sp; /* ZT_SIM_FAST_SWITCH */
  uint64_t rng;
};

__thread launch_t *t_launch;

std::vector<fiber_t> g_fibers;
std::vector<unsigned char> g_shared_arena, g_dynamic_arena;

/* The arenas' first byte at a multiple of 128, as shared memory is on the
 * GPU (a __shared__ variable's alignment is taken from there; ldmatrix
 * checks its 16-byte rows); each arena is 128 bytes longer. */
const size_t kSharedAlign = 128;
unsigned char *arena(std::vector<unsigned char> &v) {
  return (unsigned char *)(((uintptr_t)v.data() + kSharedAlign - 1) & ~(uintptr_t)(kSharedAlign - 1));
}

std::set<std::string> &fiber_names() {
  static std::set<std::string> names;
  return names;
}

std::string base_name(const char *name) {
  std::string s(name);
  size_t cut = s.find_first_of("<( ");
  return cut == std::string::npos ? s : s.substr(0, cut);
}

bool needs_fibers(const char *name) {
  static std::unordered_map<const char *, bool> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return it->second;
  bool f = fiber_names().count(base_name(name)) > 0;
  cache[name] = f;
  return f;
}

uint3 unflatten(uint64_t i, uint3 dim) {
  uint3 r;
  r.x = (unsigned)(i % dim.x);
  i /= dim.x;
  r.y = (unsigned)(i % dim.y);
  r.z = (unsigned)(i / dim.y);
  return r;
}

void ensure_stacks(int n) {
  while ((int)g_stacks.size() < n) {
    size_t len = kPage + g_set.stack;
    void *m = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                   -1, 0);
    if (m == MAP_FAILED) fatal("cannot map a fiber stack: %s", strerror(errno));
    mprotect(m, kPage, PROT_NONE);
    g_stacks.push_back({(char *)m, len});
  }
  /* Sized once: a ucontext_t must not move (it points into itself). */
  if (g_fibers.empty()) g_fibers.resize(1024);
}

/* The lanes 0 .. n - 1 of a warp (all 32 for n >= 32). */
unsigned lanes_below(int n) { return n >= 32 ? 0xffffffffu : (1u << n) - 1; }

fiber_t &lane_fiber(int warp, int lane) { return g_fibers[warp * 32 + lane]; }

/* A free entry of L->results, used by `refs` lanes. */
int new_result(launch_t *L, int refs) {
  int i;
  if (L->free_results.empty()) {
    i = (int)L->results.size();
    L->results.emplace_back();
  } else {
    i = L->free_results.back();
    L->free_results.pop_back();
  }
  L->results[i].refs = refs;
  return i;
}

/* Lane f has read what its last warp operation gathered. */
void drop_result(launch_t *L, fiber_t *f) {
  if (f->result >= 0 && --L->results[f->result].refs == 0) L->free_results.push_back(f->result);
  f->result = -1;
}

/* Releases the lanes of pending operation i of the warp when every lane
 * of its mask that exists and has not returned waits there: they share one
 * copy of the values those lanes stored (0xff bytes for the others), and
 * their slots go back to 0xff. Returns whether it did. */
bool release_if_complete(launch_t *L, int warp, int i) {
  warp_t &w = L->warps[warp];
  unsigned need = w.pend[i].mask & w.present & ~w.done;
  if (w.pend[i].waiting != need) return false;
  int r = new_result(L, __builtin_popcount(need));
  warp_slots &got = L->results[r].slots;
  memset(got, kPoison, sizeof got);
  for (int l = 0; l < 32; l++) {
    if (!(need >> l & 1u)) continue;
    memcpy(got[l], w.slots[l], sizeof got[l]);
    memset(w.slots[l], kPoison, sizeof w.slots[l]);
    fiber_t &f = lane_fiber(warp, l);
    f.result = r;
    f.st = F_RUN;
    L->runnable.push_back(warp * 32 + l);
  }
  w.pend[i] = w.pend[--w.npend];
  return true;
}

/* A returned lane no longer holds up the warp operations of its warp. */
void lane_returned(launch_t *L, fiber_t *f) {
  drop_result(L, f);
  warp_t &w = L->warps[f->warp];
  w.done |= 1u << f->lane;
  for (int i = 0; i < w.npend;)
    if (!release_if_complete(L, f->warp, i)) i++;
}

void fiber_entry() {
  launch_t *L = t_launch;
  L->body(L->ctx);
  L->cur->st = F_DONE;
  lane_returned(L, L->cur);
  /* returns to uc_link: the scheduler */
}

/* Back to the scheduler from the running fiber. */
void yield_to_scheduler(launch_t *L) {
  fiber_t *f = L->cur;
  t_op.in_thread = 0;
#ifdef ZT_SIM_FAST_SWITCH
  zt_sim_switch(&f->sp, L->sched_sp);
#else
  if (swapcontext(&f->uc, &L->sched) != 0) fatal("swapcontext failed");
#endif
}

#ifdef ZT_SIM_FAST_SWITCH
/* A new fiber's first frame: fiber_entry, then back to the scheduler for
 * good (the fiber is never switched to again). */
void fiber_start() {
  fiber_entry();
  launch_t *L = t_launch;
  void *dead;
  zt_sim_switch(&dead, L->sched_sp);
  fatal("a finished fiber was resumed");
}

/* Lays out, below `top`, what zt_sim_switch pops for a fiber that has not
 * run: MXCSR and control word, six registers, then fiber_start as the
 * return address, placed so that fiber_start starts with the stack
 * alignment of a called function. Returns the stack pointer to switch to. */
void *fiber_stack(char *top) {
  uint64_t *p = (uint64_t *)((uintptr_t)top & ~(uintptr_t)15);
  *--p = 0;                       /* fiber_start's return address: none */
  *--p = (uint64_t)(uintptr_t)fiber_start;
  for (int i = 0; i < 6; i++) *--p = 0; /* rbp rbx r12 r13 r14 r15 */
  uint32_t csr[2] = {0, 0};
  __asm__ volatile("stmxcsr %0" : "=m"(csr[0]));
  __asm__ volatile("fnstcw %0" : "=m"(csr[1]));
  *--p = (uint64_t)csr[0] | ((uint64_t)(csr[1] & 0xffff) << 32);
  return p;
}
#endif

launch_t *running_fiber_launch(const char *what) {
  launch_t *L = t_launch;
  if (!L) fatal("%s called outside a kernel", what);
  if (!L->fibers)
    fatal("kernel %s reached %s, but sim_rewrite.py did not register it as a kernel that "
          "needs fibers (a barrier it could not see: run with ZT_SIM_FIBERS=all, and fix "
          "the rewriter)",
          L->name, what);
  return L;
}

void deadlock(launch_t *L) {
  int bar = 0, warp = 0, done = 0, first_warp = -1;
  for (int i = 0; i < L->nthreads; i++) {
    fiber_state s = g_fibers[i].st;
    bar += s == F_BAR;
    done += s == F_DONE;
    if (s == F_WARP) {
      warp++;
      if (first_warp < 0) first_warp = g_fibers[i].warp;
    }
  }
  if (warp && !bar)
    fatal("kernel %s, block (%u,%u,%u): deadlock: %d lane(s) wait at a warp shuffle/vote/"
          "__syncwarp (first in warp %d) that lanes of their mask never reach (%d thread(s) "
          "of the block returned)",
          L->name, blockIdx.x, blockIdx.y, blockIdx.z, warp, first_warp, done);
  fatal("kernel %s, block (%u,%u,%u): deadlock: %d of %d threads wait at __syncthreads(), "
        "%d returned without reaching it%s",
        L->name, blockIdx.x, blockIdx.y, blockIdx.z, bar, L->nthreads, done,
        warp ? " and others wait at a warp operation" : "");
}

void poison_shared(launch_t *L) {
  if (L->shared_used) memset(arena(g_shared_arena), kPoison, L->shared_used);
  if (L->dyn_shmem) memset(arena(g_dynamic_arena), kPoison, L->dyn_shmem);
}

/* The indices 0 .. n - 1 in an order drawn from *rng. */
std::vector<uint32_t> shuffled(uint64_t n, uint64_t *rng) {
  std::vector<uint32_t> v(n);
  for (uint64_t i = 0; i < n; i++) v[i] = (uint32_t)i;
  for (uint64_t i = n - 1; i > 0; i--) std::swap(v[i], v[splitmix(rng) % (i + 1)]);
  return v;
}

void run_block_direct(launch_t *L) {
  int n = L->nthreads;
  std::vector<uint32_t> order = shuffled((uint64_t)n, &L->rng);
  for (int i = 0; i < n; i++) {
    threadIdx = unflatten(order[i], L->block);
    t_op.thread = threadIdx;
    t_op.in_thread = 1;
    L->body(L->ctx);
    t_op.in_thread = 0;
  }
}

void run_block_fibers(launch_t *L) {
  int n = L->nthreads;
  for (int i = 0; i < n; i++) {
    fiber_t &f = g_fibers[i];
#ifdef ZT_SIM_FAST_SWITCH
    f.sp = fiber_stack(g_stacks[i].map + kPage + g_set.stack);
#else
    if (!f.made) {
      if (getcontext(&f.uc) != 0) fatal("getcontext failed");
      f.made = 1;
    }
    f.uc.uc_stack.ss_sp = g_stacks[i].map + kPage;
    f.uc.uc_stack.ss_size = g_set.stack;
    f.uc.uc_stack.ss_flags = 0;
    f.uc.uc_link = &L->sched;
    makecontext(&f.uc, fiber_entry, 0);
#endif
    f.tid = unflatten((uint64_t)i, L->block);
    f.warp = i / 32;
    f.lane = i % 32;
    f.st = F_RUN;
    f.sync_rounds = 0;
    f.result = -1;
  }
  L->results.clear();
  L->free_results.clear();
  L->tally[0] = L->tally[1] = L->tally[2] = 0;
  int nwarps = (n + 31) / 32;
  L->warps.resize(nwarps);
  for (int w = 0; w < nwarps; w++) {
    warp_t &wp = L->warps[w];
    wp.present = lanes_below(n - w * 32);
    wp.done = 0;
    wp.npend = 0;
    memset(wp.slots, kPoison, sizeof wp.slots);
  }
  L->bar_arrived = 0;
  L->runnable.clear();
  for (int i = 0; i < n; i++) L->runnable.push_back(i);
  while (!L->runnable.empty()) {
    size_t j = splitmix(&L->rng) % L->runnable.size();
    int i = L->runnable[j];
    L->runnable[j] = L->runnable.back();
    L->runnable.pop_back();
    fiber_t *f = &g_fibers[i];
    L->cur = f;
    threadIdx = f->tid;
    t_op.thread = f->tid;
    t_op.in_thread = 1;
#ifdef ZT_SIM_FAST_SWITCH
    zt_sim_switch(&L->sched_sp, f->sp);
#else
    if (swapcontext(&L->sched, &f->uc) != 0) fatal("swapcontext failed");
#endif
    t_op.in_thread = 0;
  }
  L->cur = NULL;
  for (int i = 0; i < n; i++)
    if (g_fibers[i].st != F_DONE) deadlock(L);
}

}  // namespace

fiber_kernels::fiber_kernels(std::initializer_list<const char *> names) {
  for (const char *n : names) fiber_names().insert(n);
}

void *shared_var(const void *key, size_t size, size_t align, const char *name) {
  launch_t *L = t_launch;
  if (!L) fatal("__shared__ variable %s used outside a kernel", name);
  for (auto &v : L->shared_vars)
    if (v.first == key) return arena(g_shared_arena) + v.second;
  if (align < 16) align = 16;
  size_t off = (L->shared_used + align - 1) & ~(align - 1);
  if (off + size + L->dyn_shmem > kStaticShared)
    fatal("kernel %s: __shared__ %s (%zu bytes) takes the block's shared memory past %zu bytes",
          L->name, name, size, kStaticShared);
  L->shared_vars.push_back({key, off});
  memset(arena(g_shared_arena) + L->shared_used, kPoison, off + size - L->shared_used);
  L->shared_used = off + size;
  return arena(g_shared_arena) + off;
}

void *dynamic_shared(void) {
  launch_t *L = t_launch;
  if (!L) fatal("extern __shared__ memory used outside a kernel");
  return arena(g_dynamic_arena);
}

/* Lane f waits at the pending warp operation with `mask` (a new one if
 * none); returns its index. Lanes with different masks wait at different
 * operations, even when the masks overlap (lanes 0-15 at __syncwarp(0xffff)
 * while 16-31 are already at a full-warp shuffle that 0-15 reach next): a
 * lane that never comes shows as a deadlock. Ends the process when the
 * mask leaves f out. */
int join_warp_op(launch_t *L, const fiber_t *f, unsigned mask) {
  if (!(mask >> f->lane & 1u))
    fatal("kernel %s: lane %d of warp %d calls a warp operation with a mask (0x%08x) that "
          "leaves it out",
          L->name, f->lane, f->warp, mask);
  warp_t &w = L->warps[f->warp];
  int i = 0;
  while (i < w.npend && w.pend[i].mask != mask) i++;
  if (i == w.npend) w.pend[w.npend++] = warp_op{mask, 0};
  w.pend[i].waiting |= 1u << f->lane;
  return i;
}

const unsigned char *warp_exchange(unsigned mask, const void *value, size_t size, int *lane) {
  launch_t *L = running_fiber_launch("a warp shuffle, vote or __syncwarp");
  fiber_t *f = L->cur;
  warp_t &w = L->warps[f->warp];
  drop_result(L, f);
  if (value) memcpy(w.slots[f->lane], value, size);
  f->st = F_WARP;
  release_if_complete(L, f->warp, join_warp_op(L, f, mask));
  yield_to_scheduler(L);
  *lane = f->lane;
  /* Valid until this lane's next warp operation: L->results may grow (and
   * move) only when another operation completes. */
  return &L->results[f->result].slots[0][0];
}

int shfl_width(int width) {
  if (width >= 1 && width <= 32 && (width & (width - 1)) == 0) return width;
  fatal("kernel %s: a shuffle of width %d (CUDA defines the widths 1, 2, 4, 8, 16 and 32)",
        t_launch ? t_launch->name : "(none)", width);
}

void require_full_warp(const char *prefix, const char *what) {
  unsigned live = __activemask();
  if (live != 0xffffffffu)
    fatal("%s%s: only lanes 0x%08x of the warp are live; every lane must make the call", prefix,
          what, live);
}

void launch_barrier(const char *what) {
  launch_t *L = running_fiber_launch(what);
  fiber_t *f = L->cur;
  f->st = F_BAR;
  if (++L->bar_arrived == L->nthreads) {
    for (int i = 0; i < L->nthreads; i++)
      if (g_fibers[i].st == F_BAR) {
        g_fibers[i].st = F_RUN;
        L->runnable.push_back(i);
      }
    L->bar_arrived = 0;
  }
  yield_to_scheduler(L);
}

namespace {

/* The error CUDA gives a launch with this configuration (cudaSuccess when
 * it may run). */
cudaError_t launch_config_error(dim3 grid, dim3 block, size_t shmem, cudaStream_t stream) {
  if (g_set.devices <= 0) return cudaErrorNoDevice;
  if (!valid_stream(stream)) return cudaErrorInvalidResourceHandle;
  uint64_t nthreads = (uint64_t)block.x * block.y * block.z;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
      grid.z > 65535 || nthreads == 0 || nthreads > 1024 || block.x > 1024 || block.y > 1024 ||
      block.z > 64)
    return cudaErrorInvalidConfiguration;
  if (shmem > kStaticShared) return cudaErrorInvalidValue;
  return cudaSuccess;
}

/* Ends the process when a pointer argument of the kernel is not NULL and
 * not inside (or one past the end of) a live device allocation. */
void check_pointer_args(const char *name, const void *const *ptrs, int nptrs) {
  for (int i = 0; i < nptrs; i++) {
    const void *p = ptrs[i];
    if (!p) continue;
    const alloc_t *a = find_live(p);
    if (a && (const char *)p >= a->p && (const char *)p <= a->p + a->size) continue;
    if (a)
      fatal("kernel %s: pointer argument %d (%p) lies outside the %zu-byte device allocation "
            "at %p",
            name, i + 1, p, a->size, (void *)a->p);
    if (find_freed(p))
      fatal("kernel %s: pointer argument %d (%p) is device memory that was freed", name, i + 1,
            p);
    fatal("kernel %s: pointer argument %d (%p) is not device memory (a host pointer?)", name,
          i + 1, p);
  }
}

}  // namespace

cudaError_t launch(const char *name, dim3 grid, dim3 block, size_t shmem, cudaStream_t stream,
                   thread_body body, void *ctx, const void *const *ptrs, int nptrs) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  ensure_init();
  if (t_launch) fatal("kernel %s launched from inside kernel %s", name, t_launch->name);
  cudaError_t err = launch_config_error(grid, block, shmem, stream);
  if (err != cudaSuccess) return set_error(err);
  stream_work(stream);
  uint64_t nblocks = (uint64_t)grid.x * grid.y * grid.z;
  if (nblocks > UINT32_MAX)
    fatal("kernel %s: a grid of %llu blocks, more than the stand-in runs (2^32 - 1)", name,
          (unsigned long long)nblocks);
  check_pointer_args(name, ptrs, nptrs);

  launch_t L;
  L.name = name;
  L.grid = uint3{grid.x, grid.y, grid.z};
  L.block = uint3{block.x, block.y, block.z};
  L.dyn_shmem = shmem;
  L.fibers = g_set.all_fibers || needs_fibers(name);
  L.body = body;
  L.ctx = ctx;
  L.nthreads = (int)(block.x * block.y * block.z);
  L.shared_used = 0;
  L.bar_arrived = 0;
  L.cur = NULL;
  uint64_t s = g_set.seed ^ (0x5851f42d4c957f2dull * ++g_launches);
  L.rng = splitmix(&s);
  if (g_shared_arena.size() < kStaticShared + kSharedAlign)
    g_shared_arena.resize(kStaticShared + kSharedAlign);
  if (g_dynamic_arena.size() < shmem + kSharedAlign) g_dynamic_arena.resize(shmem + kSharedAlign);
  if (L.fibers) ensure_stacks(L.nthreads);

  std::vector<uint32_t> blocks = shuffled(nblocks, &L.rng);

  static __thread char what[320];
  snprintf(what, sizeof what, "kernel %s", name);
  device_access access(what);
  t_launch = &L;
  t_op.what = "kernel";
  t_op.kernel = name;
  gridDim = L.grid;
  blockDim = L.block;
  for (uint64_t b = 0; b < nblocks; b++) {
    blockIdx = unflatten(blocks[b], L.grid);
    t_op.block = blockIdx;
    poison_shared(&L);
    if (L.fibers)
      run_block_fibers(&L);
    else
      run_block_direct(&L);
  }
  t_launch = NULL;
  t_op = op_state();
  return cudaSuccess;
}

}  // namespace zt_sim

using namespace zt_sim;

void __syncthreads(void) { zt_sim::launch_barrier("__syncthreads()"); }

/* The predicate forms: a block-wide tally in three slots used in turn.
 * Round r adds to slot r % 3 before its barrier and reads it after; the
 * slot of round r + 1 was cleared in round r - 1, after a barrier that
 * every thread passed having read it. */
int __syncthreads_count(int predicate) {
  launch_t *L = running_fiber_launch("__syncthreads_count/and/or()");
  fiber_t *f = L->cur;
  unsigned r = f->sync_rounds++;
  if (predicate) L->tally[r % 3]++;
  launch_barrier("__syncthreads_count/and/or()");
  L->tally[(r + 2) % 3] = 0;
  return L->tally[r % 3];
}
int __syncthreads_and(int predicate) {
  return __syncthreads_count(!predicate) == 0;
}
int __syncthreads_or(int predicate) { return __syncthreads_count(predicate) != 0; }

void __syncwarp(unsigned mask) {
  int lane;
  (void)zt_sim::warp_exchange(mask, NULL, 0, &lane);
}

/* The lanes of the caller's warp that exist and, on fibers, have not
 * returned (the stand-in has no divergence: the others are all active). */
unsigned __activemask(void) {
  launch_t *L = t_launch;
  if (!L) zt_sim::fatal("__activemask() called outside a kernel");
  int linear = (int)(threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z));
  int w = linear / 32;
  unsigned active = lanes_below(L->nthreads - w * 32);
  return L->fibers ? active & ~L->warps[w].done : active;
}

/* ---------------------------------------------------------------------------
 * The runtime API. */

namespace {

/* One recorded piece of work of a graph: it does the work on the stream
 * the graph is launched on. */
struct graph_node {
  std::string what;
  std::function<void(cudaStream_t)> run;
};
struct graph_rec {
  std::vector<graph_node> nodes;
};
std::set<const void *> g_graphs, g_execs;
__thread char t_self; /* its address names the calling thread */
std::map<uintptr_t, size_t> g_pinned; /* cudaMallocHost's blocks */

struct stream_rec {
  unsigned flags;
  /* Host work enqueued and not done (zt_sim::stream_hold), by the seq it
   * was given, oldest first; failed: some of it will not complete before
   * an abort (zt_sim::stream_fail). */
  std::deque<unsigned long> held;
  unsigned long hseq = 0; /* held work enqueued so far (its own count: not seq's) */
  bool failed = false;
  /* A wait for another stream's held work that was failed when the
   * event was waited for (cudaStreamWaitEvent): on a GPU this stream
   * would not run on; here it reads busy until that work is released.
   * wanted counts the host's waits for the stream's work (query,
   * synchronisation, an event of it waited for): zt_sim::stream_wanted. */
  const void *stall = nullptr;
  unsigned long stall_seq = 0, wanted = 0;
  /* The cross-stream order (zt_sim::require_ordered): the device the
   * stream was made on, the device work enqueued on it (seq counts
   * kernels, copies, memsets, products, sorts), how much of it the host has
   * seen complete (synced: a stream, device or event synchronisation), and
   * for each other stream the work of it this one waits for
   * (cudaStreamWaitEvent). */
  int device = 0;
  unsigned long seq = 0, synced = 0;
  std::map<const void *, unsigned long> after;
  /* Graph capture ("Graphs" below): 0 none, 1 active, 2 invalidated; the
   * mode, the thread that began it (the address of its t_self) and the
   * nodes recorded so far. */
  int cap = 0;
  cudaStreamCaptureMode cap_mode = cudaStreamCaptureModeGlobal;
  const void *cap_thread = nullptr;
  std::vector<struct graph_node> nodes;
};
struct event_rec {
  double t;
  unsigned flags;
  int recorded;
  const void *stream = nullptr; /* where it was last recorded, and that stream's seq then */
  unsigned long seq = 0, hseq = 0; /* ... and its held work's count then */
};
std::set<const void *> g_streams, g_events;

/* Creates the record of a stream or an event, registers it in `live` and
 * stores it, as the API's handle type, at *out. */
template <typename H, typename R>
cudaError_t create_handle(H *out, const R &init, std::set<const void *> &live) {
  if (!out) return set_error(cudaErrorInvalidValue);
  R *r = new R(init);
  live.insert(r);
  *out = (H)r;
  return cudaSuccess;
}

/* Unregisters and frees the record of a stream or an event; a handle that
 * is not live is cudaErrorInvalidResourceHandle. */
template <typename R>
cudaError_t destroy_handle(const void *h, std::set<const void *> &live) {
  if (!h || !live.count(h)) return set_error(cudaErrorInvalidResourceHandle);
  live.erase(h);
  delete (const R *)h;
  return cudaSuccess;
}

double now_ms() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

cudaError_t check_device(void) {
  if (g_set.devices <= 0) return set_error(cudaErrorNoDevice);
  return cudaSuccess;
}

}  // namespace

int zt_sim::stream_hold(cudaStream_t s, int delta) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!s || !g_streams.count(s)) return -1;
  stream_rec *r = (stream_rec *)s;
  if (delta > 0) {
    r->held.push_back(++r->hseq);
    return 0;
  }
  if (r->held.empty()) fatal("stream_hold: more work done than enqueued on stream %p", s);
  r->held.pop_front();
  if (r->held.empty()) r->failed = false;
  return 0;
}

void zt_sim::stream_fail(cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (s && g_streams.count(s)) ((stream_rec *)s)->failed = true;
}

unsigned long zt_sim::stream_wanted(cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return s && g_streams.count(s) ? ((const stream_rec *)s)->wanted : 0;
}

void zt_sim::stream_work(cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (s && g_streams.count(s)) ((stream_rec *)s)->seq++;
}

void zt_sim::require_ordered(cudaStream_t s, const char *what) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  const stream_rec *b = s && g_streams.count(s) ? (const stream_rec *)s : nullptr;
  for (const void *a : g_streams) {
    const stream_rec *r = (const stream_rec *)a;
    if (a == s || (b && r->device != b->device)) continue;
    unsigned long seen = r->synced;
    if (b) {
      auto it = b->after.find(a);
      if (it != b->after.end() && it->second > seen) seen = it->second;
    }
    if (r->seq > seen)
      fatal("%s enqueued on stream %p while stream %p has %lu operation(s) that the host has not "
            "seen complete and that this stream does not wait for: on a GPU they may still be "
            "running (cudaStreamSynchronize, or cudaEventRecord and cudaStreamWaitEvent, first)",
            what, (void *)s, a, r->seq - seen);
  }
}

namespace {
/* Whether the held work of stream a up to its hseq `upto` is done (the held
 * work completes in order). */
bool done_upto(const void *a, unsigned long upto) {
  if (!a || !g_streams.count(a)) return true;
  const stream_rec *r = (const stream_rec *)a;
  return r->held.empty() || r->held.front() > upto;
}

bool stream_busy(cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!s || !g_streams.count(s)) return false;
  const stream_rec *r = (const stream_rec *)s;
  return !r->held.empty() || (r->stall && !done_upto(r->stall, r->stall_seq));
}

void want(cudaStream_t s) {
  if (s && g_streams.count(s)) ((stream_rec *)s)->wanted++;
}
}  // namespace

/* ---------------------------------------------------------------------------
 * Graphs. A stream in capture records its work as nodes (zt_sim::capture:
 * kernels from zt_sim_launch, copies and memsets here, cuBLASLt products,
 * sorts) instead of running it; cudaGraphLaunch runs the nodes in order on
 * the stream it is given, each through the same checks as when it is
 * called (pointers into live allocations, configurations), so a graph
 * that outlives a buffer it uses stops the process when it is launched.
 * As on a GPU (cudaThreadExchangeStreamCaptureMode), what would wait for
 * or depend on the device while the calling thread captures, in a mode
 * other than relaxed (synchronisations of the capturing stream or the
 * device, cudaMalloc and cudaFree, the blocking copies and memsets, a copy
 * to or from pageable host memory into the graph), fails with
 * cudaErrorStreamCaptureUnsupported and invalidates the capture:
 * cudaStreamEndCapture then returns cudaErrorStreamCaptureInvalidated and
 * no graph. The stand-in does not capture events, waits on events, NCCL
 * calls or graph launches: those fail the same way. */

namespace {

stream_rec *capture_rec(cudaStream_t s) {
  if (!s || !g_streams.count(s)) return nullptr;
  stream_rec *r = (stream_rec *)s;
  return r->cap ? r : nullptr;
}

void invalidate(stream_rec *r, const char *what) {
  if (r->cap == 1)
    fprintf(stderr, "zt-sim: %s while stream %p captures a graph: the capture is invalidated\n",
            what, (void *)r);
  r->cap = 2;
}

/* A potentially unsafe call: it fails, and invalidates the captures it
 * conflicts with, when the calling thread captures in a mode other than
 * relaxed or any thread captures in the global mode; with `every`, a
 * device-wide call, when any stream captures at all. */
cudaError_t capture_unsafe(const char *what, bool every = false) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  bool hit = false;
  for (const void *a : g_streams) {
    stream_rec *r = (stream_rec *)a;
    if (!r->cap) continue;
    if (!every && r->cap_mode == cudaStreamCaptureModeRelaxed) continue;
    if (!every && r->cap_thread != &t_self && r->cap_mode != cudaStreamCaptureModeGlobal)
      continue;
    invalidate(r, what);
    hit = true;
  }
  return hit ? set_error(cudaErrorStreamCaptureUnsupported) : cudaSuccess;
}

/* Work the stand-in cannot record on a capturing stream. */
cudaError_t capture_refuse(stream_rec *r, const char *what) {
  invalidate(r, what);
  return set_error(cudaErrorStreamCaptureUnsupported);
}

bool pinned(const void *p, size_t n) {
  auto it = g_pinned.upper_bound((uintptr_t)p);
  if (it == g_pinned.begin()) return false;
  --it;
  return (uintptr_t)p + n <= it->first + it->second;
}

}  // namespace

int zt_sim::capturing(cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return capture_rec(s) != nullptr;
}

cudaError_t zt_sim::capture(cudaStream_t s, const char *what,
                            std::function<void(cudaStream_t)> replay) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  stream_rec *r = capture_rec(s);
  if (!r) fatal("%s recorded on stream %p, which does not capture a graph", what, (void *)s);
  if (r->cap == 2) return set_error(cudaErrorStreamCaptureInvalidated);
  r->nodes.push_back(graph_node{what, std::move(replay)});
  return cudaSuccess;
}

cudaError_t zt_sim::capture_launch(cudaStream_t s, const char *name, dim3 grid, dim3 block,
                                   size_t shmem, std::function<void(cudaStream_t)> replay) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  ensure_init();
  if (t_launch) fatal("kernel %s launched from inside kernel %s", name, t_launch->name);
  cudaError_t err = launch_config_error(grid, block, shmem, s);
  if (err != cudaSuccess) {
    invalidate(capture_rec(s), "a launch with a bad configuration");
    return set_error(err);
  }
  return capture(s, name, std::move(replay));
}

int zt_sim::valid_stream(cudaStream_t s) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return s == NULL || s == cudaStreamLegacy || s == cudaStreamPerThread || g_streams.count(s);
}

extern "C" {

cudaError_t cudaGetLastError(void) {
  cudaError_t e = t_last_error;
  t_last_error = cudaSuccess;
  return e;
}

cudaError_t cudaPeekAtLastError(void) { return t_last_error; }

const char *cudaGetErrorString(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInitializationError: return "initialization error";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer: return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection: return "invalid copy direction for memcpy";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorIllegalState: return "the operation cannot be performed in the present state";
    case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureIsolation:
      return "dependency created on uncaptured work in another stream";
    case cudaErrorStreamCaptureWrongThread:
      return "attempt to terminate a thread-local capture sequence from another thread";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources: return "too many resources requested for launch";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotSupported: return "operation not supported";
    default: return "unknown error";
  }
}

const char *cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer: return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection: return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorIllegalState: return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureIsolation: return "cudaErrorStreamCaptureIsolation";
    case cudaErrorStreamCaptureWrongThread: return "cudaErrorStreamCaptureWrongThread";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    default: return "cudaErrorUnknown";
  }
}

cudaError_t cudaGetDeviceCount(int *count) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  ensure_init();
  if (!count) return set_error(cudaErrorInvalidValue);
  *count = g_set.devices > 0 ? g_set.devices : 0;
  return check_device();
}

cudaError_t cudaSetDevice(int device) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  ensure_init();
  if (g_set.devices <= 0) return set_error(cudaErrorNoDevice);
  if (device < 0 || device >= g_set.devices) return set_error(cudaErrorInvalidDevice);
  t_device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  ensure_init();
  if (!device) return set_error(cudaErrorInvalidValue);
  if (check_device() != cudaSuccess) return cudaErrorNoDevice;
  *device = t_device;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  ensure_init();
  if (!prop) return set_error(cudaErrorInvalidValue);
  if (check_device() != cudaSuccess) return cudaErrorNoDevice;
  if (device < 0 || device >= g_set.devices) return set_error(cudaErrorInvalidDevice);
  memset(prop, 0, sizeof *prop);
  snprintf(prop->name, sizeof prop->name, "zt-sim CPU stand-in %d", device);
  prop->totalGlobalMem = g_set.memory;
  prop->sharedMemPerBlock = kStaticShared;
  prop->sharedMemPerBlockOptin = kStaticShared;
  prop->sharedMemPerMultiprocessor = kStaticShared;
  prop->regsPerBlock = 65536;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024, prop->maxThreadsDim[1] = 1024, prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 0x7fffffff, prop->maxGridSize[1] = 65535, prop->maxGridSize[2] = 65535;
  prop->clockRate = 1000000;
  prop->totalConstMem = 65536;
  prop->major = 9;
  prop->minor = 0;
  prop->multiProcessorCount = 1;
  prop->maxThreadsPerMultiProcessor = 2048;
  prop->l2CacheSize = 1 << 20;
  prop->memoryBusWidth = 64;
  return cudaSuccess;
}

/* Waits for host work held on any stream (zt_sim::stream_hold). The work
 * enqueued on this device's streams before the call is then seen complete. */
cudaError_t cudaDeviceSynchronize(void) {
  if (capture_unsafe("cudaDeviceSynchronize", true) != cudaSuccess)
    return cudaErrorStreamCaptureUnsupported;
  std::map<const void *, unsigned long> done;
  {
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    for (const void *s : g_streams)
      if (((const stream_rec *)s)->device == t_device) done[s] = ((const stream_rec *)s)->seq;
  }
  for (;;) {
    bool busy = false;
    {
      std::lock_guard<std::recursive_mutex> lk(g_mu);
      for (const void *s : g_streams) busy = busy || stream_busy((cudaStream_t)s);
    }
    if (!busy) break;
    usleep(100);
  }
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  for (const auto &d : done)
    if (g_streams.count(d.first)) {
      stream_rec *r = (stream_rec *)d.first;
      if (d.second > r->synced) r->synced = d.second;
    }
  return cudaSuccess;
}
cudaError_t cudaDeviceReset(void) { return cudaSuccess; }

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  ensure_init();
  if (!free_bytes || !total_bytes) return set_error(cudaErrorInvalidValue);
  *total_bytes = g_set.memory;
  *free_bytes = g_set.memory - g_used;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int *v) {
  if (!v) return set_error(cudaErrorInvalidValue);
  *v = CUDART_VERSION;
  return cudaSuccess;
}
cudaError_t cudaRuntimeGetVersion(int *v) { return cudaDriverGetVersion(v); }

cudaError_t cudaMalloc(void **ptr, size_t size) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  ensure_init();
  if (!ptr) return set_error(cudaErrorInvalidValue);
  *ptr = NULL;
  if (capture_unsafe("cudaMalloc") != cudaSuccess) return cudaErrorStreamCaptureUnsupported;
  if (check_device() != cudaSuccess) return cudaErrorNoDevice;
  if (size == 0) return cudaSuccess;
  if (size > g_set.memory - g_used) return set_error(cudaErrorMemoryAllocation);
  size_t span = (size + kAlign - 1) & ~(kAlign - 1);
  size_t body = (span + kPage - 1) & ~(kPage - 1);
  alloc_t a;
  a.maplen = body + 2 * kPage;
  void *m = mmap(NULL, a.maplen, PROT_READ | PROT_WRITE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (m == MAP_FAILED) return set_error(cudaErrorMemoryAllocation);
  a.map = (char *)m;
  a.size = size;
  a.span = span;
  a.p = a.map + kPage + (body - span);
  mprotect(a.map, kPage, PROT_NONE);
  mprotect(a.map + a.maplen - kPage, kPage, PROT_NONE);
  fill_canary(data_begin(a), (size_t)(a.p - data_begin(a)));
  memset(a.p, kPoison, a.size);
  fill_canary(a.p + a.size, span - size);
  if (!g_set.host_access && g_access_depth == 0) protect(a, PROT_NONE);
  g_allocs[(uintptr_t)a.p] = a;
  g_used += size;
  *ptr = a.p;
  return cudaSuccess;
}

cudaError_t cudaFree(void *ptr) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  ensure_init();
  if (!ptr) return cudaSuccess;
  if (capture_unsafe("cudaFree") != cudaSuccess) return cudaErrorStreamCaptureUnsupported;
  auto it = g_allocs.find((uintptr_t)ptr);
  if (it == g_allocs.end()) {
    if (find_freed(ptr))
      fprintf(stderr, "zt-sim: cudaFree(%p): freed already (double free)\n", ptr);
    return set_error(cudaErrorInvalidValue);
  }
  alloc_t a = it->second;
  if (g_access_depth == 0 || g_set.host_access) {
    /* Writes past the end since the last device work would have been
     * caught then; check once more before the memory goes. */
    if (!g_set.host_access) protect(a, PROT_READ);
    const char *bad = damaged(a);
    if (bad)
      fatal("cudaFree(%p): the pad or slack of the %zu-byte allocation was overwritten", ptr,
            a.size);
  }
  g_allocs.erase(it);
  g_used -= a.size;
  madvise(a.map, a.maplen, MADV_DONTNEED);
  mprotect(a.map, a.maplen, PROT_NONE);
  g_freed.push_back(a);
  g_freed_bytes += a.maplen;
  while ((g_freed_bytes > kQuarantine || g_freed.size() > kQuarantineCount) && !g_freed.empty()) {
    munmap(g_freed.front().map, g_freed.front().maplen);
    g_freed_bytes -= g_freed.front().maplen;
    g_freed.pop_front();
  }
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void **ptr, size_t size) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!ptr) return set_error(cudaErrorInvalidValue);
  *ptr = NULL;
  if (capture_unsafe("cudaMallocHost") != cudaSuccess) return cudaErrorStreamCaptureUnsupported;
  *ptr = malloc(size ? size : 1);
  if (!*ptr) return set_error(cudaErrorMemoryAllocation);
  g_pinned[(uintptr_t)*ptr] = size;
  return cudaSuccess;
}

cudaError_t cudaFreeHost(void *ptr) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!ptr) return cudaSuccess;
  if (capture_unsafe("cudaFreeHost") != cudaSuccess) return cudaErrorStreamCaptureUnsupported;
  if (!g_pinned.erase((uintptr_t)ptr)) return set_error(cudaErrorInvalidValue);
  free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  ensure_init();
  if (!valid_stream(stream)) return set_error(cudaErrorInvalidResourceHandle);
  if (count == 0) return cudaSuccess;
  if (!dst || !src) return set_error(cudaErrorInvalidValue);
  bool ddev = in_device_memory(dst, count), sdev = in_device_memory(src, count);
  bool dany = find_live(dst) || find_freed(dst), sany = find_live(src) || find_freed(src);
  switch (kind) {
    case cudaMemcpyHostToHost:
      if (dany || sany) return set_error(cudaErrorInvalidValue);
      break;
    case cudaMemcpyHostToDevice:
      if (!ddev || sany) return set_error(cudaErrorInvalidValue);
      break;
    case cudaMemcpyDeviceToHost:
      if (!sdev || dany) return set_error(cudaErrorInvalidValue);
      break;
    case cudaMemcpyDeviceToDevice:
      if (!ddev || !sdev) return set_error(cudaErrorInvalidValue);
      break;
    case cudaMemcpyDefault:
      if ((dany && !ddev) || (sany && !sdev)) return set_error(cudaErrorInvalidValue);
      break;
    default: return set_error(cudaErrorInvalidMemcpyDirection);
  }
  if (stream_rec *r = capture_rec(stream)) {
    /* A host buffer in a graph must be page-locked (cudaMallocHost). */
    if ((!sdev && !pinned(src, count)) || (!ddev && !pinned(dst, count)))
      return capture_refuse(r, "a copy to or from pageable host memory");
    return capture(stream, "cudaMemcpyAsync", [=](cudaStream_t s) {
      cudaError_t e = cudaMemcpyAsync(dst, src, count, kind, s);
      if (e != cudaSuccess) fatal("graph launch: cudaMemcpyAsync failed: %s", cudaGetErrorString(e));
    });
  }
  device_access access("cudaMemcpy");
  memmove(dst, src, count);
  stream_work(stream);
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, cudaMemcpyKind kind) {
  if (capture_unsafe("cudaMemcpy") != cudaSuccess) return cudaErrorStreamCaptureUnsupported;
  return cudaMemcpyAsync(dst, src, count, kind, NULL);
}

cudaError_t cudaMemsetAsync(void *ptr, int value, size_t count, cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  ensure_init();
  if (!valid_stream(stream)) return set_error(cudaErrorInvalidResourceHandle);
  if (count == 0) return cudaSuccess;
  if (!in_device_memory(ptr, count)) return set_error(cudaErrorInvalidValue);
  if (capture_rec(stream))
    return capture(stream, "cudaMemsetAsync", [=](cudaStream_t s) {
      cudaError_t e = cudaMemsetAsync(ptr, value, count, s);
      if (e != cudaSuccess) fatal("graph launch: cudaMemsetAsync failed: %s", cudaGetErrorString(e));
    });
  device_access access("cudaMemset");
  memset(ptr, value, count);
  stream_work(stream);
  return cudaSuccess;
}

cudaError_t cudaMemset(void *ptr, int value, size_t count) {
  if (capture_unsafe("cudaMemset") != cudaSuccess) return cudaErrorStreamCaptureUnsupported;
  return cudaMemsetAsync(ptr, value, count, NULL);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  ensure_init();
  if (flags > cudaStreamNonBlocking) return set_error(cudaErrorInvalidValue);
  stream_rec r;
  r.flags = flags, r.device = t_device;
  return create_handle(stream, r, g_streams);
}

cudaError_t cudaStreamCreate(cudaStream_t *stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  /* A later stream may get the same address: nothing may still refer to
   * this one's order. */
  for (const void *s : g_streams) {
    ((stream_rec *)s)->after.erase(stream);
    if (((stream_rec *)s)->stall == (const void *)stream) ((stream_rec *)s)->stall = nullptr;
  }
  for (const void *e : g_events)
    if (((const event_rec *)e)->stream == stream) ((event_rec *)e)->stream = nullptr;
  return destroy_handle<stream_rec>(stream, g_streams);
}

/* Kernels and copies run when they are launched, so only host work a
 * stream holds (stream_hold) is ever outstanding. */
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  if (!valid_stream(stream)) return set_error(cudaErrorInvalidResourceHandle);
  {
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (stream_rec *r = capture_rec(stream)) return capture_refuse(r, "cudaStreamSynchronize");
  }
  unsigned long target = 0; /* the work enqueued before the call */
  {
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (stream && g_streams.count(stream)) target = ((const stream_rec *)stream)->seq;
    want(stream);
  }
  while (stream_busy(stream)) usleep(100);
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (stream && g_streams.count(stream) && target > ((stream_rec *)stream)->synced)
    ((stream_rec *)stream)->synced = target;
  return cudaSuccess;
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
  if (!valid_stream(stream)) return set_error(cudaErrorInvalidResourceHandle);
  std::lock_guard<std::recursive_mutex> lk(g_mu); /* done: the host has seen it complete */
  if (stream_rec *r = capture_rec(stream)) return capture_refuse(r, "cudaStreamQuery");
  want(stream);
  if (stream_busy(stream)) return cudaErrorNotReady;
  if (stream && g_streams.count(stream)) ((stream_rec *)stream)->synced = ((stream_rec *)stream)->seq;
  return cudaSuccess;
}

/* Work here runs when it is enqueued, so a stream that waits for another
 * one's held work (a collective) waits now, on the host; if that work has
 * failed (it completes only at the abort), the stream stalls instead:
 * busy until it is released, as a GPU stream would be. */
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  const void *a = nullptr;
  unsigned long upto = 0, seq = 0;
  {
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (!valid_stream(stream) || !g_events.count(event))
      return set_error(cudaErrorInvalidResourceHandle);
    if (stream_rec *r = capture_rec(stream))
      return capture_refuse(r, "cudaStreamWaitEvent (the stand-in records no events in a graph)");
    const event_rec *e = (const event_rec *)event;
    if (e->stream && g_streams.count(e->stream) && e->stream != (const void *)stream)
      a = e->stream, upto = e->hseq, seq = e->seq;
    want((cudaStream_t)a);
  }
  for (;;) {
    {
      std::lock_guard<std::recursive_mutex> lk(g_mu);
      if (!a || !g_streams.count(a) || done_upto(a, upto)) break;
      if (((const stream_rec *)a)->failed) {
        if (stream && g_streams.count(stream))
          ((stream_rec *)stream)->stall = a, ((stream_rec *)stream)->stall_seq = upto;
        break;
      }
    }
    usleep(50);
  }
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (stream && g_streams.count(stream) && a && g_streams.count(a)) {
    unsigned long &w = ((stream_rec *)stream)->after[a];
    if (seq > w) w = seq;
  }
  return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (flags & ~(unsigned)(cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess))
    return set_error(cudaErrorInvalidValue);
  event_rec r;
  r.t = 0.0, r.flags = flags, r.recorded = 0;
  return create_handle(event, r, g_events);
}

cudaError_t cudaEventCreate(cudaEvent_t *event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return destroy_handle<event_rec>(event, g_events);
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!g_events.count(event) || !valid_stream(stream))
    return set_error(cudaErrorInvalidResourceHandle);
  if (stream_rec *r = capture_rec(stream))
    return capture_refuse(r, "cudaEventRecord (the stand-in records no events in a graph)");
  event_rec *e = (event_rec *)event;
  e->t = now_ms();
  e->recorded = 1;
  e->stream = stream && g_streams.count(stream) ? (const void *)stream : nullptr;
  e->seq = e->stream ? ((const stream_rec *)stream)->seq : 0;
  e->hseq = e->stream ? ((const stream_rec *)stream)->hseq : 0;
  return cudaSuccess;
}

/* Marks the event's work seen complete by the host. */
static void event_seen(const event_rec *e) {
  if (e->stream && g_streams.count(e->stream)) {
    stream_rec *r = (stream_rec *)e->stream;
    if (e->seq > r->synced) r->synced = e->seq;
  }
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  for (;;) {
    {
      std::lock_guard<std::recursive_mutex> lk(g_mu);
      if (!g_events.count(event)) return set_error(cudaErrorInvalidResourceHandle);
      const event_rec *e = (const event_rec *)event;
      want((cudaStream_t)e->stream);
      if (done_upto(e->stream, e->hseq)) {
        event_seen(e);
        return cudaSuccess;
      }
    }
    usleep(50);
  }
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!g_events.count(event)) return set_error(cudaErrorInvalidResourceHandle);
  const event_rec *e = (const event_rec *)event;
  want((cudaStream_t)e->stream);
  if (!done_upto(e->stream, e->hseq)) return cudaErrorNotReady;
  event_seen(e);
  return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!ms) return set_error(cudaErrorInvalidValue);
  if (!g_events.count(start) || !g_events.count(end))
    return set_error(cudaErrorInvalidResourceHandle);
  event_rec *a = (event_rec *)start, *b = (event_rec *)end;
  if ((a->flags | b->flags) & cudaEventDisableTiming)
    return set_error(cudaErrorInvalidResourceHandle);
  if (!a->recorded || !b->recorded) return set_error(cudaErrorInvalidResourceHandle);
  *ms = (float)(b->t - a->t);
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  ensure_init();
  if (!valid_stream(stream)) return set_error(cudaErrorInvalidResourceHandle);
  if (mode != cudaStreamCaptureModeGlobal && mode != cudaStreamCaptureModeThreadLocal &&
      mode != cudaStreamCaptureModeRelaxed)
    return set_error(cudaErrorInvalidValue);
  /* The legacy stream cannot capture; the stand-in captures created
   * streams only. */
  if (!stream || !g_streams.count(stream)) return set_error(cudaErrorStreamCaptureUnsupported);
  stream_rec *r = (stream_rec *)stream;
  if (r->cap) return set_error(cudaErrorIllegalState);
  r->cap = 1;
  r->cap_mode = mode;
  r->cap_thread = &t_self;
  r->nodes.clear();
  return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *graph) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!graph) return set_error(cudaErrorInvalidValue);
  *graph = NULL;
  if (!valid_stream(stream)) return set_error(cudaErrorInvalidResourceHandle);
  stream_rec *r = capture_rec(stream);
  if (!r) return set_error(cudaErrorIllegalState);
  if (r->cap_mode != cudaStreamCaptureModeRelaxed && r->cap_thread != &t_self)
    return set_error(cudaErrorStreamCaptureWrongThread);
  int state = r->cap;
  std::vector<graph_node> nodes;
  nodes.swap(r->nodes);
  r->cap = 0;
  r->cap_thread = nullptr;
  if (state == 2) return set_error(cudaErrorStreamCaptureInvalidated);
  graph_rec *gr = new graph_rec{std::move(nodes)};
  g_graphs.insert(gr);
  *graph = (cudaGraph_t)gr;
  return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus *status) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!status) return set_error(cudaErrorInvalidValue);
  if (!valid_stream(stream)) return set_error(cudaErrorInvalidResourceHandle);
  stream_rec *r = capture_rec(stream);
  *status = !r ? cudaStreamCaptureStatusNone
               : r->cap == 1 ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusInvalidated;
  return cudaSuccess;
}

/* With nodes NULL, the count; else up to *count node handles (the
 * stand-in's records, good for nothing but counting). */
cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t *nodes, size_t *count) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!count) return set_error(cudaErrorInvalidValue);
  if (!graph || !g_graphs.count(graph)) return set_error(cudaErrorInvalidResourceHandle);
  std::vector<graph_node> &v = ((graph_rec *)graph)->nodes;
  if (!nodes) {
    *count = v.size();
    return cudaSuccess;
  }
  size_t n = *count < v.size() ? *count : v.size();
  for (size_t i = 0; i < n; i++) nodes[i] = (cudaGraphNode_t)&v[i];
  *count = n;
  return cudaSuccess;
}

/* An executable graph is a copy of the graph's nodes: the graph may be
 * destroyed at once. */
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph,
                                 unsigned long long flags) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  if (!exec) return set_error(cudaErrorInvalidValue);
  *exec = NULL;
  if (!graph || !g_graphs.count(graph)) return set_error(cudaErrorInvalidResourceHandle);
  if (flags) return set_error(cudaErrorInvalidValue); /* no instantiation flags here */
  graph_rec *x = new graph_rec(*(const graph_rec *)graph);
  g_execs.insert(x);
  *exec = (cudaGraphExec_t)x;
  return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
  std::vector<graph_node> nodes;
  {
    std::lock_guard<std::recursive_mutex> lk(g_mu);
    if (!exec || !g_execs.count(exec) || !valid_stream(stream))
      return set_error(cudaErrorInvalidResourceHandle);
    if (stream_rec *r = capture_rec(stream))
      return capture_refuse(r, "cudaGraphLaunch (the stand-in does not nest graphs)");
    nodes = ((const graph_rec *)exec)->nodes;
  }
  for (const graph_node &n : nodes) n.run(stream);
  return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return destroy_handle<graph_rec>(graph, g_graphs);
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  std::lock_guard<std::recursive_mutex> lk(g_mu);
  return destroy_handle<graph_rec>(exec, g_execs);
}

}  // extern "C"
