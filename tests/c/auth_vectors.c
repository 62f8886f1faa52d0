/* Checks bpf/include/inband/siphash.h and auth.h against
 * tests/vectors/siphash.txt and tests/vectors/mac.txt, the vectors the Rust
 * side (crates/inband/src/wire.rs) is tested on too.
 * Build and run: make -C tests/c (the test command does it). */
#include <arpa/inet.h>
#include <stdio.h>
#include <string.h>

#include "inband/auth.h"

static int hex_bytes(const char *s, unsigned char *out, int max)
{
	int n = 0, off;

	while (n < max && sscanf(s, " %2hhx%n", &out[n], &off) == 1) {
		s += off;
		n++;
	}
	return n;
}

static int endpoint(const char *s, __be32 *addr, __be16 *port)
{
	char ip[32];
	unsigned p;

	if (sscanf(s, "%31[^:]:%u", ip, &p) != 2 || inet_pton(AF_INET, ip, addr) != 1)
		return 0;
	*port = htons((unsigned short)p);
	return 1;
}

static struct inband_auth_key make_key(const unsigned char *k)
{
	struct inband_auth_key key = { .k0 = inband_le64(k), .k1 = inband_le64(k + 8), .valid = 1 };

	return key;
}

static int siphash_vectors(const char *path)
{
	FILE *f = fopen(path, "r");
	char line[512], keyhex[64], msghex[200];
	int passed = 0, failed = 0;

	if (!f) {
		perror(path);
		return 1;
	}
	while (fgets(line, sizeof(line), f)) {
		unsigned char key[16], msg[64], want[8];
		char *eq = strchr(line, '=');
		int n;

		if (line[0] == '#' || !eq || sscanf(line, "%63s %199s", keyhex, msghex) != 2)
			continue;
		hex_bytes(keyhex, key, 16);
		n = strcmp(msghex, "ff") ? hex_bytes(msghex, msg, 64) : 0;
		hex_bytes(eq + 1, want, 8);
		struct inband_auth_key k = make_key(key);
		__u64 got = n == 0   ? inband_siphash24_words(k.k0, k.k1, msg, 0)
			    : n == 8  ? inband_siphash24_words(k.k0, k.k1, msg, 1)
			    : n == 16 ? inband_siphash24_words(k.k0, k.k1, msg, 2)
			    : n == 24 ? inband_siphash24_words(k.k0, k.k1, msg, 3)
				      : inband_siphash24_words(k.k0, k.k1, msg, 4);
		unsigned char g[8];

		inband_put_mac(g, got);
		if (!memcmp(g, want, 8)) {
			passed++;
		} else {
			fprintf(stderr, "FAIL siphash of %d bytes\n", n);
			failed++;
		}
	}
	fclose(f);
	printf("siphash: %d passed, %d failed\n", passed, failed);
	return failed || passed < 5;
}

static int mac_vectors(const char *path)
{
	FILE *f = fopen(path, "r");
	char line[512];
	int passed = 0, failed = 0;

	if (!f) {
		perror(path);
		return 1;
	}
	while (fgets(line, sizeof(line), f)) {
		char kind[32], keyhex[64], lb[64], be[64], nonce_s[32], arg[64] = "";
		unsigned key_id;
		unsigned char key[16], want[32], got[32];
		__be32 lb_addr, be_addr, client_addr = 0;
		__be16 lb_port, be_port, client_port = 0;
		char *eq = strchr(line, '=');
		int glen = 0;

		if (line[0] == '#' || !eq)
			continue;
		*eq = 0;
		if (sscanf(line, "%31s %63s %u %63s %63s %31s %63s", kind, keyhex, &key_id, lb, be, nonce_s, arg) < 6 ||
		    !endpoint(lb, &lb_addr, &lb_port) || !endpoint(be, &be_addr, &be_port)) {
			fprintf(stderr, "bad vector: %s\n", line);
			return 1;
		}
		hex_bytes(keyhex, key, 16);
		struct inband_auth_key k = make_key(key);
		struct inband_mac_msg m;
		int wlen = hex_bytes(eq + 1, want, 32);

		if (!strcmp(kind, "client_tuple")) {
			unsigned long seq = strtoul(nonce_s, NULL, 10);

			endpoint(arg, &client_addr, &client_port);
			inband_mac_msg_init(&m, INBAND_OPT_CLIENT_TUPLE, key_id, htonl((__u32)seq), lb_addr, lb_port, be_addr,
					    be_port);
			m.client_addr = client_addr;
			m.client_port = client_port;
			inband_encode_auth_client_tuple(got, key_id, client_addr, client_port, inband_mac(&k, &m));
			glen = INBAND_OPT_AUTH_CLIENT_TUPLE_LEN;
		} else {
			__be32 nonce;
			unsigned char nb[4];

			hex_bytes(nonce_s, nb, 4);
			memcpy(&nonce, nb, 4);
			if (!strcmp(kind, "score_request")) {
				inband_mac_msg_init(&m, INBAND_OPT_SCORE_REQUEST, key_id, nonce, lb_addr, lb_port, be_addr,
						    be_port);
				inband_encode_auth_score_request(got, key_id, nonce, inband_mac(&k, &m));
				glen = INBAND_OPT_AUTH_SCORE_REQUEST_LEN;
			} else {
				unsigned short score = (unsigned short)atoi(arg);

				inband_mac_msg_init(&m, INBAND_OPT_SCORE, key_id, nonce, lb_addr, lb_port, be_addr,
						    be_port);
				m.score = htons(score);
				inband_encode_auth_score(got, score, nonce, inband_mac(&k, &m));
				glen = INBAND_OPT_AUTH_SCORE_LEN;
			}
		}
		if (glen == wlen && !memcmp(got, want, glen)) {
			passed++;
		} else {
			fprintf(stderr, "FAIL %s key id %u\n", kind, key_id);
			failed++;
		}
	}
	fclose(f);
	printf("mac: %d passed, %d failed\n", passed, failed);
	return failed || passed < 6;
}

int main(int argc, char **argv)
{
	const char *dir = argc > 1 ? argv[1] : "tests/vectors";
	char a[512], b[512];

	snprintf(a, sizeof(a), "%s/siphash.txt", dir);
	snprintf(b, sizeof(b), "%s/mac.txt", dir);
	return siphash_vectors(a) | mac_vectors(b);
}
