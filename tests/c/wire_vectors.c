/* Checks bpf/include/inband/wire.h's encoders against tests/vectors/wire.txt,
 * the same vectors the Rust mirror (crates/inband/src/wire.rs) is tested on.
 * Build and run: make -C tests/c (the test command does it). */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "inband/wire.h"

int main(int argc, char **argv)
{
	const char *path = argc > 1 ? argv[1] : "tests/vectors/wire.txt";
	FILE *f = fopen(path, "r");
	char line[256];
	int passed = 0, failed = 0;

	if (!f) {
		perror(path);
		return 2;
	}
	while (fgets(line, sizeof(line), f)) {
		unsigned char got[48], want[48], opt[40];
		char name[32], a[128], b[128];
		int glen = 0, wlen = 0, off = 0, n;
		char *eq = strchr(line, '=');

		if (line[0] == '#' || !eq)
			continue;
		*eq = 0;
		n = sscanf(line, "%31s %127s %127s", name, a, b);
		if (!strcmp(name, "client_tuple") && n == 3) {
			unsigned char ip[16];

			if (inet_pton(AF_INET, a, ip) == 1) {
				__be32 v4;

				memcpy(&v4, ip, 4);
				inband_encode_client_tuple(got, v4, htons((unsigned short)atoi(b)));
				glen = INBAND_OPT_CLIENT_TUPLE_LEN;
			} else {
				inet_pton(AF_INET6, a, ip);
				inband_encode_client_tuple6(got, ip, htons((unsigned short)atoi(b)));
				glen = INBAND_OPT6_CLIENT_TUPLE_LEN;
			}
		} else if (!strcmp(name, "score_request")) {
			inband_encode_score_request(got);
			glen = INBAND_OPT_SCORE_REQUEST_LEN;
		} else if (!strcmp(name, "score") && n == 2) {
			inband_encode_score(got, (unsigned short)atoi(a));
			glen = INBAND_OPT_SCORE_LEN;
		} else if (!strcmp(name, "doh") && n == 3) {
			/* "doh <next header> <option hex>": a is the next header. */
			int olen = 0;

			for (char *p = b; olen < 40 && sscanf(p, "%2hhx%n", &opt[olen], &off) == 1; p += off)
				olen++;
			memset(got, 0xee, sizeof(got)); /* padding must be written, not left */
			memcpy(got + INBAND_DOH_PREFIX, opt, olen);
			inband_doh_wrap(got, (unsigned char)atoi(a), olen);
			glen = INBAND_DOH_LEN(olen);
		} else {
			fprintf(stderr, "unknown vector: %s\n", line);
			return 2;
		}
		for (char *p = eq + 1; wlen < 48 && sscanf(p, "%hhx%n", &want[wlen], &off) == 1; p += off)
			wlen++;
		if (glen == wlen && !memcmp(got, want, glen)) {
			passed++;
		} else {
			fprintf(stderr, "FAIL %s %s %s\n", name, n > 1 ? a : "", n > 2 ? b : "");
			failed++;
		}
	}
	fclose(f);
	printf("%d passed, %d failed\n", passed, failed);
	return failed || !passed;
}
