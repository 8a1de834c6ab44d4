// A stand-in libcuda.so.1 for CPU tests of runtime/cuda.py's ctypes bindings.
//
// Implements the driver calls the runtime makes with host memory: physical
// allocations are memfd files (so exported handles are real file descriptors
// that can travel between processes), address reservations are PROT_NONE
// mappings (a hint is honoured when the range is free), cuMemMap maps the
// memfd there, and "device" memory is ordinary host memory.  Every call
// checks its arguments the way the real driver documents them, so a wrong
// struct layout, handle type or 64-bit argument shows up as an error.
// Built by tests/test_multiprocess.py: cc -shared -fPIC -o libcuda.so.1 mock_libcuda.c
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long u64;
enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_SUPPORTED = 801 };
#define GRANULARITY (1 << 16)

typedef struct { int type; int id; } Location;
typedef struct {
  int type, requestedHandleTypes;
  Location location;
  void *win32;
  unsigned char compressionType, gpuDirectRDMACapable;
  unsigned short usage;
  unsigned char reserved[4];
} Prop;
typedef struct { Location location; int flags; } AccessDesc;

// handle -> (memfd + 1) << 1 | exportable
static u64 make_handle(int fd, int exportable) { return ((u64)(fd + 1) << 1) | (exportable & 1); }
static int handle_fd(u64 h) { return (int)(h >> 1) - 1; }

static int check_prop(const Prop *p) {
  return p && p->type == 1 && p->location.type == 1 && p->location.id >= 0 && !p->win32 &&
         (p->requestedHandleTypes == 0 || p->requestedHandleTypes == 1);
}

CUresult cuInit(unsigned flags) { return flags ? INVALID_VALUE : OK; }
CUresult cuDeviceGet(int *dev, int ordinal) { *dev = ordinal; return ordinal < 0 ? INVALID_VALUE : OK; }
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
  *v = attr == 16 ? 132 : (attr == 102 || attr == 103) ? 1 : 0;
  return OK;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = (void *)(intptr_t)(dev + 1); return OK; }
static void *current;
CUresult cuCtxPushCurrent_v2(void *ctx) { if (!ctx) return INVALID_VALUE; current = ctx; return OK; }
CUresult cuCtxPopCurrent_v2(void **ctx) { *ctx = current; current = 0; return OK; }
CUresult cuCtxSynchronize(void) { return current ? OK : INVALID_VALUE; }
CUresult cuStreamSynchronize(void *stream) { return current ? OK : INVALID_VALUE; }

CUresult cuMemGetAllocationGranularity(size_t *g, const Prop *p, int option) {
  if (!check_prop(p) || (option != 0 && option != 1)) return INVALID_VALUE;
  *g = GRANULARITY;
  return OK;
}
CUresult cuMemCreate(u64 *h, size_t size, const Prop *p, u64 flags) {
  if (!check_prop(p) || flags || !size || size % GRANULARITY) return INVALID_VALUE;
  if (!current) return INVALID_VALUE;
  int fd = memfd_create("mock-cumem", 0);
  if (fd < 0 || ftruncate(fd, (off_t)size)) return OUT_OF_MEMORY;
  *h = make_handle(fd, p->requestedHandleTypes == 1);
  return OK;
}
CUresult cuMemRelease(u64 h) { return close(handle_fd(h)) ? INVALID_VALUE : OK; }
CUresult cuMemExportToShareableHandle(void *out, u64 h, int type, u64 flags) {
  if (type != 1 || flags || !(h & 1)) return INVALID_VALUE;  // exportable only if requested
  *(int *)out = dup(handle_fd(h));
  return OK;
}
CUresult cuMemImportFromShareableHandle(u64 *h, void *os_handle, int type) {
  int fd = (int)(intptr_t)os_handle;
  if (type != 1 || fcntl(fd, F_GETFD) < 0) return INVALID_VALUE;
  *h = make_handle(dup(fd), 0);
  return OK;
}
CUresult cuMemAddressReserve(u64 *ptr, size_t size, size_t align, u64 addr, u64 flags) {
  if (flags || !size || size % GRANULARITY || (align & (align - 1))) return INVALID_VALUE;
  void *p = MAP_FAILED;
  if (addr)
    p = mmap((void *)addr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE |
             MAP_FIXED_NOREPLACE, -1, 0);
  if (p == MAP_FAILED)
    p = mmap(0, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (p == MAP_FAILED) return OUT_OF_MEMORY;
  *ptr = (u64)(uintptr_t)p;
  return OK;
}
CUresult cuMemAddressFree(u64 ptr, size_t size) { return munmap((void *)ptr, size) ? INVALID_VALUE : OK; }
CUresult cuMemMap(u64 ptr, size_t size, size_t offset, u64 h, u64 flags) {
  if (flags || offset || size % GRANULARITY) return INVALID_VALUE;
  void *p = mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, handle_fd(h), 0);
  return p == MAP_FAILED ? INVALID_VALUE : OK;
}
CUresult cuMemUnmap(u64 ptr, size_t size) {
  void *p = mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE |
                 MAP_FIXED, -1, 0);
  return p == MAP_FAILED ? INVALID_VALUE : OK;
}
CUresult cuMemSetAccess(u64 ptr, size_t size, const AccessDesc *desc, size_t count) {
  if (!count) return INVALID_VALUE;
  for (size_t i = 0; i < count; i++)
    if (desc[i].location.type != 1 || desc[i].location.id < 0 || desc[i].flags != 3)
      return INVALID_VALUE;
  return mprotect((void *)ptr, size, PROT_READ | PROT_WRITE) ? INVALID_VALUE : OK;
}
CUresult cuMemsetD8_v2(u64 ptr, unsigned char v, size_t n) {
  if (!current) return INVALID_VALUE;
  memset((void *)ptr, v, n);
  return OK;
}
CUresult cuMemcpyHtoD_v2(u64 dst, const void *src, size_t n) {
  if (!current) return INVALID_VALUE;
  memcpy((void *)dst, src, n);
  return OK;
}
CUresult cuMemHostAlloc(void **p, size_t n, unsigned flags) {
  if (!current) return INVALID_VALUE;
  *p = calloc(1, n);
  return *p ? OK : OUT_OF_MEMORY;
}
CUresult cuMemHostGetDevicePointer_v2(u64 *d, void *p, unsigned flags) {
  *d = (u64)(uintptr_t)p;
  return flags ? INVALID_VALUE : OK;
}
