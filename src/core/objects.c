/* The registry of live worlds, comms and handles: every public call finds its objects here
 * before it reads them, so a destroyed (freed) pointer is refused rather than dereferenced.
 * A handful of objects are live at a time, so a list under one mutex is enough. */
#include <pthread.h>
#include <stdlib.h>

#include "core/internal.h"

typedef struct {
  const void *obj;
  epxi_obj_kind_t kind;
} entry_t;

/* Recursive: a function run under epxi_obj_with may look up or unregister other objects. */
static pthread_mutex_t reg_mu;
static pthread_once_t reg_once = PTHREAD_ONCE_INIT;
static entry_t *reg;
static size_t reg_n, reg_cap;

static void reg_init(void) {
  pthread_mutexattr_t a;
  pthread_mutexattr_init(&a);
  pthread_mutexattr_settype(&a, PTHREAD_MUTEX_RECURSIVE);
  pthread_mutex_init(&reg_mu, &a);
  pthread_mutexattr_destroy(&a);
}

static void reg_lock(void) {
  pthread_once(&reg_once, reg_init);
  pthread_mutex_lock(&reg_mu);
}

static uint32_t magic_of(epxi_obj_kind_t kind) {
  switch (kind) {
    case EPXI_OBJ_WORLD: return EPXI_MAGIC_WORLD;
    case EPXI_OBJ_COMM: return EPXI_MAGIC_COMM;
    case EPXI_OBJ_HANDLE: return EPXI_MAGIC_HANDLE;
  }
  return EPXI_MAGIC_DEAD;
}

/* The object's magic word: each of the three structs starts with it. */
static uint32_t *magic_word(const void *obj) { return (uint32_t *)obj; }

/* Index of a live obj of that kind, or -1 (lock held). */
static long find(const void *obj, epxi_obj_kind_t kind) {
  for (size_t i = 0; i < reg_n; i++)
    if (reg[i].obj == obj) return reg[i].kind == kind && *magic_word(obj) == magic_of(kind) ? (long)i : -1;
  return -1;
}

epx_status_t epxi_obj_register(void *obj, epxi_obj_kind_t kind) {
  reg_lock();
  if (reg_n == reg_cap) {
    size_t cap = reg_cap ? 2 * reg_cap : 64;
    entry_t *grown = realloc(reg, cap * sizeof *grown);
    if (!grown) {
      pthread_mutex_unlock(&reg_mu);
      return epxi_fail(EPX_ERR_OUT_OF_MEMORY, "the registry of live epx objects");
    }
    reg = grown;
    reg_cap = cap;
  }
  *magic_word(obj) = magic_of(kind);
  reg[reg_n++] = (entry_t){obj, kind};
  pthread_mutex_unlock(&reg_mu);
  return EPX_SUCCESS;
}

bool epxi_obj_live(const void *obj, epxi_obj_kind_t kind) {
  if (!obj) return false;
  reg_lock();
  bool live = find(obj, kind) >= 0;
  pthread_mutex_unlock(&reg_mu);
  return live;
}

static const char *kind_name(epxi_obj_kind_t kind) {
  return kind == EPXI_OBJ_WORLD ? "world" : kind == EPXI_OBJ_COMM ? "comm" : "handle";
}

epx_status_t epxi_obj_with(const void *obj, epxi_obj_kind_t kind, const char *what,
                           epx_status_t (*fn)(void *obj, void *arg), void *arg) {
  if (!obj) return epxi_fail(EPX_ERR_NULL_POINTER, "%s: %s is NULL", what, kind_name(kind));
  reg_lock();
  epx_status_t s = find(obj, kind) >= 0 ? fn((void *)obj, arg)
                                        : epxi_fail(EPX_ERR_INVALID_ARGUMENT,
                                                    "%s: the %s is not a live epx %s (destroyed already?)", what,
                                                    kind_name(kind), kind_name(kind));
  pthread_mutex_unlock(&reg_mu);
  return s;
}

bool epxi_obj_unregister(void *obj, epxi_obj_kind_t kind) {
  reg_lock();
  long i = obj ? find(obj, kind) : -1;
  if (i >= 0) {
    reg[i] = reg[--reg_n];
    *magic_word(obj) = EPXI_MAGIC_DEAD;
  }
  if (reg_n == 0) { /* nothing live: give the table back (a leak checker sees none) */
    free(reg);
    reg = NULL;
    reg_cap = 0;
  }
  pthread_mutex_unlock(&reg_mu);
  return i >= 0;
}
