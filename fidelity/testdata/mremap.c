// mremap: memory a program moves or grows with mremap must behave as
// anonymous memory does in a copy too. It holds three 1 MiB regions of
// private anonymous memory full of a pattern:
//
//	merged  with a 3-page neighbour right after it (the kernel merges the two
//	        into one VMA): growing it must read zeros after the old end;
//	moved   moved elsewhere with MREMAP_FIXED, then purged with
//	        MADV_DONTNEED: the moved bytes must be intact, the purge must
//	        read zeros;
//	lone    a gap after it: growing it must work and read zeros.
//
// Prints "ready", then on each SIGUSR1 runs the three checks once (they
// change the regions: one check per process) and prints
// "check merged=R moved=R lone=R" where R is zeros or ok (as anonymous
// memory), refused (the call failed), stale (bytes other than zeros where
// zeros belong) or corrupt (the old bytes changed).
#define _GNU_SOURCE
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define PG 4096UL
#define MB (1UL << 20)

static volatile sig_atomic_t want;
static void on_usr1(int s) { (void)s; want = 1; }

static char *merged, *moved, *lone, *target;

static void fill(char *p, size_t n, int seed) {
	for (size_t i = 0; i < n; i += 8)
		*(uint64_t *)(p + i) = (i + 1) * 0x9E3779B97F4A7C15ULL ^ (uint64_t)seed;
}

static int intact(const char *p, size_t n, int seed) {
	for (size_t i = 0; i < n; i += 8)
		if (*(const uint64_t *)(p + i) != ((i + 1) * 0x9E3779B97F4A7C15ULL ^ (uint64_t)seed))
			return 0;
	return 1;
}

static int zeros(const char *p, size_t n) {
	for (size_t i = 0; i < n; i++)
		if (p[i])
			return 0;
	return 1;
}

static const char *grow(char *p, int seed) {
	char *q = mremap(p, MB, 2 * MB, MREMAP_MAYMOVE);
	if (q == MAP_FAILED)
		return "refused";
	if (!intact(q, MB, seed))
		return "corrupt";
	return zeros(q + MB, MB) ? "zeros" : "stale";
}

static const char *move(void) {
	char *q = mremap(moved, MB, MB, MREMAP_MAYMOVE | MREMAP_FIXED, target);
	if (q == MAP_FAILED)
		return "refused";
	if (!intact(q, MB, 3))
		return "corrupt";
	if (madvise(q, MB, MADV_DONTNEED))
		return "refused";
	return zeros(q, MB) ? "zeros" : "stale";
}

int main(void) {
	setvbuf(stdout, NULL, _IOLBF, 0);
	// Room for [merged][neighbour] gap [moved] gap [lone] gap [target] gap.
	char *base = mmap(NULL, 16 * MB, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (base == MAP_FAILED)
		return 2;
	munmap(base, 16 * MB);
	int fl = MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE;
	merged = mmap(base, MB, PROT_READ | PROT_WRITE, fl, -1, 0);
	char *nb = mmap(base + MB, 3 * PG, PROT_READ | PROT_WRITE, fl, -1, 0);
	moved = mmap(base + 4 * MB, MB, PROT_READ | PROT_WRITE, fl, -1, 0);
	lone = mmap(base + 8 * MB, MB, PROT_READ | PROT_WRITE, fl, -1, 0);
	target = base + 12 * MB;
	if (merged == MAP_FAILED || nb == MAP_FAILED || moved == MAP_FAILED || lone == MAP_FAILED)
		return 2;
	fill(merged, MB, 1);
	fill(nb, 3 * PG, 2);
	fill(moved, MB, 3);
	fill(lone, MB, 4);
	signal(SIGUSR1, on_usr1);
	printf("ready\n");
	for (;;) {
		while (!want)
			pause();
		want = 0;
		const char *m = grow(merged, 1);
		const char *v = move();
		const char *l = grow(lone, 4);
		if (!strcmp(l, "zeros"))
			l = "ok";
		printf("check merged=%s moved=%s lone=%s\n", m, v, l);
	}
}
