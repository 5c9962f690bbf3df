/* A stand-in for libnccl.so.2 with NCCL's C signatures, for tests/test_nccl.py on machines without
 * NCCL: calling it through commfuse.nccl's ctypes table checks that table against a real C ABI (a
 * 64-bit pointer passed as a C int, or the unique id passed by pointer instead of by value, shows up
 * in what the stub records). A communicator of one rank whose all-reduce copies send to recv
 * (memmove: recv may be send). stub_* set and read what it recorded.
 *
 * On a GPU (stub_on_device): the copy is enqueued on the stream (cuMemcpyDtoDAsync), and stub_hang_next
 * makes the next all-reduces first enqueue a wait that only ncclCommAbort ends (cuStreamWaitValue32 on a
 * host-mapped word the abort sets): a peer that never arrives, on one GPU, also inside a CUDA graph. The
 * driver's functions are looked up at run time, so the stub builds without CUDA.
 *
 * stub_block_next makes the next all-reduce's enqueue itself wait, in the calling thread, until ncclCommAbort
 * (from another thread) ends it: NCCL connecting to a peer that never comes, or its queue full behind a
 * stalled kernel. Then it fails with ncclInternalError, as NCCL's aborted calls do; after 20 s without an
 * abort it fails with ncclSystemError, so that a test of a broken watchdog fails instead of hanging. */
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

typedef struct { char internal[128]; } ncclUniqueId;
typedef struct { int magic; } stubComm;

static stubComm the_comm = {0x5eed};
static int next_result, async_error, destroyed, aborted, last_nranks = -1, last_rank = -1;
static ncclUniqueId last_id;
static const void* last_send;
static void* last_recv;
static size_t last_count;
static int last_datatype = -1, last_op = -1;
static void* last_stream;

/* The next call returns this result (then ncclSuccess again). */
void stub_fail_next(int result) { next_result = result; }
void stub_set_async_error(int result) { async_error = result; }
int stub_destroyed(void) { return destroyed; }
int stub_aborted(void) { return aborted; }
int stub_last_nranks(void) { return last_nranks; }
int stub_last_rank(void) { return last_rank; }
void stub_last_id(ncclUniqueId* out) { *out = last_id; }
size_t stub_last_count(void) { return last_count; }
int stub_last_datatype(void) { return last_datatype; }
int stub_last_op(void) { return last_op; }
void* stub_last_stream(void) { return last_stream; }
const void* stub_last_send(void) { return last_send; }
void* stub_last_recv(void) { return last_recv; }

static int take_result(void) { int r = next_result; next_result = 0; return r; }

/* ---- on a GPU: libcuda's functions, and the word that releases hung all-reduces */
typedef int (*MemcpyAsync)(unsigned long long dst, unsigned long long src, size_t bytes, void* stream);
typedef int (*WaitValue32)(void* stream, unsigned long long address, unsigned value, unsigned flags);
typedef int (*HostAlloc)(void** host, size_t bytes, unsigned flags);
typedef int (*HostDevicePointer)(unsigned long long* device, void* host, unsigned flags);
static MemcpyAsync memcpy_async;
static WaitValue32 wait_value32;
static volatile unsigned* release_word; /* host-mapped: 1 ends every hung all-reduce */
static unsigned long long release_address;
static int on_device, hang_next;

/* All-reduces act on device pointers from now on (1) or on host memory (0). Returns 0, or -1 where
 * libcuda or one of its functions is missing, or the word cannot be allocated (a CUDA context must be
 * current: torch's, after its first CUDA call). */
int stub_on_device(int on) {
  if (on && release_word == NULL) {
    void* cuda = dlopen("libcuda.so.1", RTLD_NOW);
    if (cuda == NULL) return -1;
    HostAlloc host_alloc = (HostAlloc)dlsym(cuda, "cuMemHostAlloc");
    HostDevicePointer device_pointer = (HostDevicePointer)dlsym(cuda, "cuMemHostGetDevicePointer_v2");
    memcpy_async = (MemcpyAsync)dlsym(cuda, "cuMemcpyDtoDAsync_v2");
    wait_value32 = (WaitValue32)dlsym(cuda, "cuStreamWaitValue32_v2");
    if (host_alloc == NULL || device_pointer == NULL || memcpy_async == NULL || wait_value32 == NULL) return -1;
    void* host = NULL;
    if (host_alloc(&host, sizeof(unsigned), 0x3 /* PORTABLE | DEVICEMAP */) != 0) return -1;
    if (device_pointer(&release_address, host, 0) != 0) return -1;
    release_word = (volatile unsigned*)host;
  }
  on_device = on;
  return 0;
}

/* The next `count` all-reduces hang until ncclCommAbort (on a device only). */
void stub_hang_next(int count) {
  hang_next = count;
  if (release_word != NULL) *release_word = 0;
}

static int block_next, block_aborted; /* block_aborted: written by the aborting thread, read by the blocked one */

/* The next all-reduce blocks in the host until ncclCommAbort (see the top). */
void stub_block_next(void) {
  __atomic_store_n(&block_aborted, 0, __ATOMIC_SEQ_CST);
  block_next = 1;
}

/* ncclInternalError where an abort ended the wait, ncclSystemError after 20 s without one. */
static int block_until_aborted(void) {
  const struct timespec tick = {0, 1000000};
  for (int ms = 0; ms < 20000; ++ms) {
    if (__atomic_load_n(&block_aborted, __ATOMIC_SEQ_CST)) return 3;
    nanosleep(&tick, NULL);
  }
  return 2;
}

int ncclGetVersion(int* version) { *version = 22809; return take_result(); }

const char* ncclGetErrorString(int result) {
  switch (result) {
    case 0: return "no error";
    case 2: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case 3: return "internal error - please report this issue to the NCCL developers";
    case 4: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case 5: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(void* comm) { (void)comm; return "stub: the last error"; }

int ncclGetUniqueId(ncclUniqueId* id) {
  for (int i = 0; i < 128; ++i) id->internal[i] = (char)(i * 7 + 3);
  return take_result();
}

int ncclCommInitRank(stubComm** comm, int nranks, ncclUniqueId id, int rank) {
  last_nranks = nranks; last_rank = rank; last_id = id;
  int r = take_result();
  if (r == 0) *comm = &the_comm;
  return r;
}

static size_t element_size(int datatype) {
  switch (datatype) { case 6: case 9: return 2; case 7: return 4; default: return 0; }
}

int ncclAllReduce(const void* send, void* recv, size_t count, int datatype, int op, stubComm* comm, void* stream) {
  last_send = send; last_recv = recv; last_count = count; last_datatype = datatype; last_op = op; last_stream = stream;
  int r = take_result();
  if (r != 0) return r;
  if (comm != &the_comm || element_size(datatype) == 0 || op != 0) return 4;
  if (block_next) {
    block_next = 0;
    return block_until_aborted();
  }
  if (!on_device) {
    memmove(recv, send, count * element_size(datatype));
    return 0;
  }
  if (hang_next > 0) {
    --hang_next;
    if (wait_value32(stream, release_address, 1, 0 /* CU_STREAM_WAIT_VALUE_GEQ */) != 0) return 1;
  }
  if (recv != send && memcpy_async((uintptr_t)recv, (uintptr_t)send, count * element_size(datatype), stream) != 0)
    return 1;
  return 0;
}

int ncclCommGetAsyncError(stubComm* comm, int* result) { (void)comm; *result = async_error; return take_result(); }
int ncclCommDestroy(stubComm* comm) { (void)comm; ++destroyed; return take_result(); }
int ncclCommAbort(stubComm* comm) {
  (void)comm;
  ++aborted;
  __atomic_store_n(&block_aborted, 1, __ATOMIC_SEQ_CST);
  if (release_word != NULL) *release_word = 1; /* what an abort does to NCCL's kernels: they end */
  return take_result();
}
