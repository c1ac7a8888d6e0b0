/*
 * device.c: the kernel table for a device name; finds, loads and
 * initialises the CUDA kernel table (see device.h).
 *
 * Only five entry points of libzt_kernels_cuda.so are used, resolved by
 * dlsym: zt_kernels_cuda_init, zt_kernels_cuda, zt_kernels_cuda_bf16,
 * zt_kernels_cuda_set_math and zt_cuda_device_memory (their contracts are in
 * kernels/cuda/zt_kernels_cuda.h). The handle is kept for
 * the life of the process: the library owns the CUDA context and stream.
 */
#include <dlfcn.h>
#include <libgen.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "device.h"
#include "zt_common.h"

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static void *g_lib;
static int (*g_init)(int, char *, size_t);
static const zt_kernels_t *(*g_table)(void);
static const zt_kernels_t *(*g_table_bf16)(void);
static void (*g_set_math)(int);
static size_t (*g_memory)(void);

int zt_device_parse(const char *device) {
  if (!device || !strcmp(device, "cpu")) return -1;
  if (!strcmp(device, "cuda")) return 0;
  if (!strncmp(device, "cuda:", 5)) {
    char *end = NULL;
    long n = strtol(device + 5, &end, 10);
    if (end != device + 5 && *end == 0 && n >= 0 && n < 1024) return (int)n;
  }
  zt_err("device \"%s\": expected cpu, cuda or cuda:N", device);
  return -2;
}

/* Where `cmake --install` puts the library, relative to the binaries
 * (kernels/CMakeLists.txt): ../lib/ztrain for bin/zworker. */
#ifndef ZT_PKGLIB_REL
#define ZT_PKGLIB_REL "../lib/ztrain"
#endif

/* Opens the library from the first place that has it: $ZT_CUDA_KERNELS,
 * the build tree's lib/ beside bin/, the installed layout, the loader's
 * search path. -1 with the reasons. */
static int open_library(void) {
  char tried[2000] = "", self[ZT_PATH_MAX], build[ZT_PATH_MAX], inst[ZT_PATH_MAX];
  const char *env = zt_env(ZT_ENV_CUDA_KERNELS);
  const char *paths[4] = {env, NULL, NULL, "libzt_kernels_cuda.so"};
  ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    self[n] = 0;
    const char *dir = dirname(self);
    if (zt_path_fmt(build, sizeof build, "%s/../lib/libzt_kernels_cuda.so", dir) == 0)
      paths[1] = build;
    if (zt_path_fmt(inst, sizeof inst, "%s/%s/libzt_kernels_cuda.so", dir, ZT_PKGLIB_REL) == 0)
      paths[2] = inst;
  }
  for (int i = 0; i < 4; i++) {
    if (!paths[i]) continue;
    g_lib = dlopen(paths[i], RTLD_NOW | RTLD_LOCAL);
    if (g_lib) return 0;
    size_t len = strlen(tried);
    snprintf(tried + len, sizeof tried - len, "%s%s", len ? "; " : "", dlerror());
  }
  return zt_err("cannot load the CUDA kernels (libzt_kernels_cuda.so): %s", tried);
}

static const zt_kernels_t *cuda_kernels(int index, int bf16) {
  const zt_kernels_t *t = NULL;
  pthread_mutex_lock(&g_mu);
  if (!g_lib) {
    if (open_library() != 0) goto out;
    *(void **)&g_init = dlsym(g_lib, "zt_kernels_cuda_init");
    *(void **)&g_table = dlsym(g_lib, "zt_kernels_cuda");
    *(void **)&g_table_bf16 = dlsym(g_lib, "zt_kernels_cuda_bf16");
    *(void **)&g_set_math = dlsym(g_lib, "zt_kernels_cuda_set_math");
    *(void **)&g_memory = dlsym(g_lib, "zt_cuda_device_memory");
    if (!g_init || !g_table || !g_table_bf16 || !g_set_math || !g_memory) {
      zt_err("libzt_kernels_cuda.so lacks an entry point: %s", dlerror());
      dlclose(g_lib);
      g_lib = NULL;
      goto out;
    }
  }
  char err[256];
  if (g_init(index, err, sizeof err) != 0) {
    zt_err("cuda:%d: %s", index, err);
    goto out;
  }
  g_set_math(bf16 ? 2 /* ZT_CUDA_MATH_BF16 */ : 0 /* ZT_CUDA_MATH_FP32 */);
  t = bf16 ? g_table_bf16() : g_table();
out:
  pthread_mutex_unlock(&g_mu);
  return t;
}

const zt_kernels_t *zt_device_kernels(const char *device, int bf16) {
  int index = zt_device_parse(device);
  if (index == -2) return NULL;
  if (index == -1) return zt_kernels_cpu();
  return cuda_kernels(index, bf16);
}

uint64_t zt_device_memory(const char *device) {
  int index = zt_device_parse(device);
  if (index < 0 || !cuda_kernels(index, 0)) return 0;
  return (uint64_t)g_memory();
}
