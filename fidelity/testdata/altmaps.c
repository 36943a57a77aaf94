// altmaps: N private file mappings alternating with N private anonymous ones,
// one page each, so that no two neighbours merge: 2N mappings. It speaks the
// workloads line protocol (see internal/workloads):
//
//	tick N bad=0 maps=M           every tick (M: lines of /proc/self/maps)
//	verify tick=N ok=0|1 bad=B maps=M marker=V   after SIGUSR1
//	marker tick=N value=V          after SIGUSR2 (written into every anonymous page)
//
// Usage: altmaps -n PAIRS -t TICK_MS -f FILE (FILE is created, PAIRS pages).
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PG 4096UL

static volatile sig_atomic_t want_verify, want_mark;
static void on_usr1(int s) { (void)s; want_verify = 1; }
static void on_usr2(int s) { (void)s; want_mark = 1; }

static uint64_t filev(uint64_t i, uint64_t w) { return (i * 0x9E3779B97F4A7C15ULL) ^ (w * 0x100000001B3ULL) ^ 0xF11E; }
static uint64_t anonv(uint64_t i, uint64_t w) { return (i * 0xC2B2AE3D27D4EB4FULL) ^ (w * 0x165667B19E3779F9ULL) ^ 0xA404; }

static long count_maps(void) {
	FILE *f = fopen("/proc/self/maps", "r");
	if (!f)
		return -1;
	long n = 0;
	int c;
	while ((c = getc(f)) != EOF)
		if (c == '\n')
			n++;
	fclose(f);
	return n;
}

int main(int argc, char **argv) {
	long pairs = 1000, tick_ms = 100;
	const char *path = NULL;
	int o;
	while ((o = getopt(argc, argv, "n:t:f:")) != -1) {
		switch (o) {
		case 'n': pairs = atol(optarg); break;
		case 't': tick_ms = atol(optarg); break;
		case 'f': path = optarg; break;
		default: return 2;
		}
	}
	if (!path || pairs <= 0)
		return 2;
	setvbuf(stdout, NULL, _IOLBF, 0);

	int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
	if (fd < 0 || ftruncate(fd, pairs * PG) < 0) {
		perror("file");
		return 1;
	}
	uint64_t *buf = malloc(PG);
	for (long i = 0; i < pairs; i++) {
		for (uint64_t w = 0; w < PG / 8; w++)
			buf[w] = filev(i, w);
		if (pwrite(fd, buf, PG, i * PG) != (ssize_t)PG) {
			perror("pwrite");
			return 1;
		}
	}
	char *base = mmap(NULL, 2 * pairs * PG, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
	if (base == MAP_FAILED) {
		perror("reserve");
		return 1;
	}
	for (long i = 0; i < pairs; i++) {
		char *f = base + 2 * i * PG, *a = f + PG;
		if (mmap(f, PG, PROT_READ, MAP_PRIVATE | MAP_FIXED, fd, i * PG) == MAP_FAILED ||
		    mmap(a, PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0) == MAP_FAILED) {
			fprintf(stderr, "mmap pair %ld: %s\n", i, strerror(errno));
			return 1;
		}
		uint64_t *p = (uint64_t *)a;
		for (uint64_t w = 1; w < PG / 8; w++)
			p[w] = anonv(i, w);
		p[0] = 0; // the marker
	}
	close(fd);
	signal(SIGUSR1, on_usr1);
	signal(SIGUSR2, on_usr2);
	uint64_t marker = 0;
	struct timespec ts = {tick_ms / 1000, (tick_ms % 1000) * 1000000L};
	for (uint64_t tick = 1;; tick++) {
		if (want_mark) {
			want_mark = 0;
			marker = ((uint64_t)getpid() << 32) ^ (tick * 7919) ^ (uint64_t)time(NULL);
			for (long i = 0; i < pairs; i++)
				*(uint64_t *)(base + (2 * i + 1) * PG) = marker;
			printf("marker tick=%lu value=%lu\n", (unsigned long)tick, (unsigned long)marker);
		}
		if (want_verify) {
			want_verify = 0;
			long bad = 0, badmark = 0;
			for (long i = 0; i < pairs; i++) {
				uint64_t *f = (uint64_t *)(base + 2 * i * PG), *a = (uint64_t *)(base + (2 * i + 1) * PG);
				for (uint64_t w = 0; w < PG / 8; w++) {
					if (f[w] != filev(i, w))
						bad++;
					if (w > 0 && a[w] != anonv(i, w))
						bad++;
				}
				if (a[0] != marker)
					badmark++;
			}
			printf("verify tick=%lu ok=%d bad=%ld badmarker=%ld maps=%ld marker=%lu\n", (unsigned long)tick,
			       bad == 0 && badmark == 0, bad, badmark, count_maps(), (unsigned long)marker);
		}
		printf("tick %lu bad=0\n", (unsigned long)tick);
		nanosleep(&ts, NULL);
	}
}
