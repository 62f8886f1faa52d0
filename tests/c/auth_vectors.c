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

/* An endpoint as the vectors write it: a.b.c.d:port or [v6]:port. */
struct ep {
	int v6;
	unsigned char addr[16]; /* IPv4 in the first 4 bytes */
	__be16 port;
};

static int endpoint(const char *s, struct ep *e)
{
	char ip[64];
	unsigned p;

	memset(e, 0, sizeof(*e));
	if (s[0] == '[') {
		if (sscanf(s, "[%63[^]]]:%u", ip, &p) != 2 || inet_pton(AF_INET6, ip, e->addr) != 1)
			return 0;
		e->v6 = 1;
	} else if (sscanf(s, "%63[^:]:%u", ip, &p) != 2 || inet_pton(AF_INET, ip, e->addr) != 1) {
		return 0;
	}
	e->port = htons((unsigned short)p);
	return 1;
}

/* The MAC of an option over lb -> be (and the client, for a 155), in the
 * message of their family (auth.h). */
static __u64 vector_mac(const struct inband_auth_key *k, __u8 kind, __u8 key_id, __be32 nonce, const struct ep *lb,
			const struct ep *be, const struct ep *client, __u16 score, int udp)
{
	if (!lb->v6) {
		struct inband_mac_msg m;
		__be32 la, ba;

		memcpy(&la, lb->addr, 4);
		memcpy(&ba, be->addr, 4);
		inband_mac_msg_init(&m, kind, key_id, nonce, la, lb->port, ba, be->port);
		m.tag[1] = inband_mac_tag(udp ? 17 : 6);
		if (client) {
			memcpy(&m.client_addr, client->addr, 4);
			m.client_port = client->port;
		}
		m.score = htons(score);
		return inband_mac(k, &m);
	}
	struct inband_mac_msg6 m;

	inband_mac_msg6_init(&m, kind, key_id, nonce, lb->addr, lb->port, be->addr, be->port);
	m.tag[1] = inband_mac_tag(udp ? 17 : 6);
	if (client) {
		memcpy(m.client_addr, client->addr, 16);
		m.client_port = client->port;
	}
	m.score = htons(score);
	return inband_mac6(k, &m);
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
		char kind[32], keyhex[64], lb_s[64], be_s[64], nonce_s[32], arg[64] = "";
		unsigned key_id;
		unsigned char key[16], want[48], got[48];
		struct ep lb, be, client;
		char *eq = strchr(line, '=');
		int glen = 0;

		if (line[0] == '#' || !eq)
			continue;
		*eq = 0;
		if (sscanf(line, "%31s %63s %u %63s %63s %31s %63s", kind, keyhex, &key_id, lb_s, be_s, nonce_s, arg) < 6 ||
		    !endpoint(lb_s, &lb) || !endpoint(be_s, &be)) {
			fprintf(stderr, "bad vector: %s\n", line);
			return 1;
		}
		/* A "_udp" kind is the same option on a UDP flow. */
		char *suffix = strstr(kind, "_udp");
		int udp = suffix != NULL;

		if (suffix)
			*suffix = 0;
		hex_bytes(keyhex, key, 16);
		struct inband_auth_key k = make_key(key);
		int wlen = hex_bytes(eq + 1, want, 48);

		if (!strcmp(kind, "client_tuple")) {
			__be32 nonce = htonl((__u32)strtoul(nonce_s, NULL, 10));

			endpoint(arg, &client);
			__u64 mac = vector_mac(&k, INBAND_OPT_CLIENT_TUPLE, key_id, nonce, &lb, &be, &client, 0, udp);
			int alen = client.v6 ? 16 : 4;

			inband_encode_auth_client_tuple(got, key_id, client.addr, alen, client.port, udp, nonce, mac);
			glen = INBAND_AUTH_TUPLE_MAC_OFF(alen, udp) + INBAND_OPT_MAC_LEN;
		} else {
			__be32 nonce;
			unsigned char nb[4];

			hex_bytes(nonce_s, nb, 4);
			memcpy(&nonce, nb, 4);
			if (!strcmp(kind, "score_request")) {
				inband_encode_auth_score_request(
					got, key_id, nonce,
					vector_mac(&k, INBAND_OPT_SCORE_REQUEST, key_id, nonce, &lb, &be, NULL, 0, udp));
				glen = INBAND_OPT_AUTH_SCORE_REQUEST_LEN;
			} else {
				unsigned short score = (unsigned short)atoi(arg);

				inband_encode_auth_score(
					got, score, nonce,
					vector_mac(&k, INBAND_OPT_SCORE, key_id, nonce, &lb, &be, NULL, score, udp));
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
	return failed || passed < 14;
}

int main(int argc, char **argv)
{
	const char *dir = argc > 1 ? argv[1] : "tests/vectors";
	char a[512], b[512];

	snprintf(a, sizeof(a), "%s/siphash.txt", dir);
	snprintf(b, sizeof(b), "%s/mac.txt", dir);
	return siphash_vectors(a) | mac_vectors(b);
}
