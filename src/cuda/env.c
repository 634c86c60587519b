/* The process environment that ranks of one process sharing a GPU need, set when such a world
 * is created and only then (one rank per GPU, or per process, needs neither):
 *   CUDA_DEVICE_MAX_CONNECTIONS=32  kernels of the ranks wait on each other, so no rank's stream
 *                                   may queue behind another's in one hardware queue (the
 *                                   default is 8);
 *   CUDA_MODULE_LOADING=EAGER       a lazily loaded kernel's first launch can wait for the device
 *                                   to go idle, which never happens while peers spin.
 * Both act only if CUDA has not started in this process yet; when it has, a warning says so.
 * A variable the caller set is left alone. */
#define _GNU_SOURCE /* RTLD_NOLOAD */
#include <dirent.h>
#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#include "core/internal.h"

/* GPUs this process would see, without starting CUDA: CUDA_VISIBLE_DEVICES' entries, or the
 * driver's list; -1 when neither says. */
static int visible_gpus(void) {
  int listed = -1;
  DIR *d = opendir("/proc/driver/nvidia/gpus");
  if (d) {
    listed = 0;
    for (struct dirent *e; (e = readdir(d));) listed += e->d_name[0] != '.';
    closedir(d);
  }
  const char *v = getenv("CUDA_VISIBLE_DEVICES");
  if (!v) return listed;
  int n = 0;
  for (const char *p = v; *p;) {
    const size_t len = strcspn(p, ",");
    if (len == 0 || !strncmp(p, "-1", 2)) break; /* CUDA stops at the first invalid entry */
    n++;
    p += len + (p[len] == ',');
  }
  return listed >= 0 && listed < n ? listed : n;
}

/* Whether two ranks of [first, first + num_local) would be on one GPU, as world_create will
 * place them (rank r on devices[r], or on r % count); true when that cannot be known. */
static bool ranks_share_gpu(const epx_world_config_t *wc, int first, int num_local) {
  if (num_local < 2) return false;
  const int count = visible_gpus();
  int dev[EPX_MAX_RANKS];
  for (int i = 0; i < num_local; i++) {
    const int r = first + i;
    dev[i] = wc->devices && wc->devices[r] >= 0 ? wc->devices[r] : count > 0 ? r % count : -1;
    if (dev[i] < 0) return true;
    for (int j = 0; j < i; j++)
      if (dev[j] == dev[i]) return true;
  }
  return false;
}

/* What CUDA has done in this process so far, asked of the driver only if it is loaded (so the
 * question starts nothing). */
typedef struct {
  bool initialised; /* cuInit has run */
  bool lazy;        /* modules load lazily */
  bool context;     /* some GPU's primary context exists */
} cuda_started_t;

static cuda_started_t cuda_started(void) {
  cuda_started_t st = {false, false, false};
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
  if (!lib) return st;
  int (*count_fn)(int *) = (int (*)(int *))dlsym(lib, "cuDeviceGetCount");
  int (*mode_fn)(int *) = (int (*)(int *))dlsym(lib, "cuModuleGetLoadingMode");
  int (*state_fn)(int, unsigned *, int *) = (int (*)(int, unsigned *, int *))dlsym(lib, "cuDevicePrimaryCtxGetState");
  int n = 0, mode = 0;
  st.initialised = count_fn && count_fn(&n) == 0; /* CUDA_ERROR_NOT_INITIALIZED before cuInit */
  if (st.initialised && mode_fn && mode_fn(&mode) == 0) st.lazy = mode == 2; /* CU_MODULE_LAZY_LOADING */
  for (int d = 0; st.initialised && state_fn && d < n; d++) { /* CUdevice d is ordinal d */
    unsigned flags = 0;
    int active = 0;
    if (state_fn(d, &flags, &active) == 0 && active) st.context = true;
  }
  dlclose(lib);
  return st;
}

void epxi_cuda_world_env(const epx_world_config_t *wc, int first_rank, int num_local) {
  if (!ranks_share_gpu(wc, first_rank, num_local)) return;
  const cuda_started_t st = cuda_started();
  const bool set_queues = !getenv("CUDA_DEVICE_MAX_CONNECTIONS"), set_loading = !getenv("CUDA_MODULE_LOADING");
  if (set_queues) setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 0);
  if (set_loading) setenv("CUDA_MODULE_LOADING", "EAGER", 0);
  if (set_queues && st.initialised)
    EPX_WARN("ranks of this process share a GPU, but CUDA started (%s) before epx set CUDA_DEVICE_MAX_CONNECTIONS=32, "
             "which may then not take effect: set it before CUDA starts (a rank's stream may queue behind another's "
             "and stall the group)",
             st.context ? "a GPU's context exists" : "initialised");
  if (set_loading && st.lazy)
    EPX_WARN("ranks of this process share a GPU, but CUDA started with lazy module loading before epx could set "
             "CUDA_MODULE_LOADING=EAGER: set it before CUDA starts (a kernel's first launch may stall the group; "
             "epx loads its own kernels at epx_comm_init)");
}
