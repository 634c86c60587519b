/* test_sha256: the bootstrap's SHA-256 and HMAC-SHA256 against the published test vectors
 * (FIPS 180-4 examples, RFC 4231 cases 1, 2, 6), and one-byte-at-a-time updates against
 * whole-message ones on fresh random messages of every length across block boundaries. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "core/internal.h"
#include "testutil.h"

static void hex(const uint8_t *d, char *out) {
  for (int i = 0; i < EPXI_SHA256_BYTES; i++) sprintf(out + 2 * i, "%02x", d[i]);
}

static void sha(const char *msg, size_t n, const char *want) {
  epxi_sha256_t s;
  uint8_t d[EPXI_SHA256_BYTES];
  char got[65];
  epxi_sha256_init(&s);
  epxi_sha256_update(&s, msg, n);
  epxi_sha256_final(&s, d);
  hex(d, got);
  CHECK(strcmp(got, want) == 0, "sha256 of %zu bytes: %s, want %s", n, got, want);
}

static void hmac(const void *key, size_t kn, const void *msg, size_t mn, const char *want) {
  uint8_t d[EPXI_SHA256_BYTES];
  char got[65];
  epxi_hmac_sha256(key, kn, msg, mn, d);
  hex(d, got);
  CHECK(strcmp(got, want) == 0, "hmac key %zu bytes msg %zu bytes: %s, want %s", kn, mn, got, want);
}

int main(void) {
  tu_begin("test_sha256");
  sha("", 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  sha("abc", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  const char *two = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
  sha(two, strlen(two), "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  uint8_t k1[20];
  memset(k1, 0x0b, sizeof k1);
  hmac(k1, sizeof k1, "Hi There", 8, "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  hmac("Jefe", 4, "what do ya want for nothing?", 28,
       "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  uint8_t k6[131];
  memset(k6, 0xaa, sizeof k6);
  const char *m6 = "Test Using Larger Than Block-Size Key - Hash Key First";
  hmac(k6, sizeof k6, m6, strlen(m6), "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");

  tu_rng_t *g = &tu_rng;
  for (size_t n = 0; n < 300; n++) {
    uint8_t msg[300], a[EPXI_SHA256_BYTES], b[EPXI_SHA256_BYTES];
    for (size_t i = 0; i < n; i++) msg[i] = (uint8_t)tu_u64(g);
    epxi_sha256_t s;
    epxi_sha256_init(&s);
    epxi_sha256_update(&s, msg, n);
    epxi_sha256_final(&s, a);
    epxi_sha256_init(&s);
    for (size_t i = 0; i < n; i++) epxi_sha256_update(&s, msg + i, 1);
    epxi_sha256_final(&s, b);
    CHECK(memcmp(a, b, sizeof a) == 0, "a %zu-byte message hashed in one update and byte by byte differ", n);
    CHECK(epxi_equal_ct(a, b, sizeof a), "equal digests compare equal");
    b[n % sizeof b] ^= (uint8_t)(1u << (n % 8));
    CHECK(!epxi_equal_ct(a, b, sizeof a), "digests one bit apart compare different");
  }
  return tu_end();
}
