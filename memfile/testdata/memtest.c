// memtest: a process tree with a known heap, driven by signals, for the
// memfile tests. Usage: memtest CTLDIR HEAP_MIB CHILDREN [DEPTH]
// (each child dirties pages [0,10) of R, then forks a chain of DEPTH-1
// descendants that keep those pages)
//
// Memory: R (HEAP_MIB, one word pattern per page "seed"), N (12 KiB right
// after R, flags differ so it stays its own VMA), G (4 MiB with 64 MiB free
// after it, for in-place growth), W (2 pages, MADV_WIPEONFORK, its first word
// set by every process after its fork), plus a malloc'ed seed table.
// Signals (handled in the main loop):
//   SIGUSR1  verify everything          -> "verify ok=1 bad=0 wipe=W0 wipe_addr=A"
//   SIGHUP   dirty pages [10,20) of R with seed 3 -> "dirty ok=1 ..."
//   SIGUSR2  mremap growth: R by 16 MiB (moves: N is in the way) and G by
//            16 MiB in place; count nonzero words in the new parts -> "grow ..."
//   SIGTTIN  dirty half of R with seed 4 (a big delta) -> "dirty ok=1 ..."
// Each report is written to CTLDIR/report-<host pid> (tmp + rename); the host
// pid comes from /proc/self, which is the host's procfs.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define PAGE 4096UL
static const char *ctl;
static size_t rlen, npages;
static uint64_t *R, *G;
static unsigned char *N;
static volatile uint64_t *W;
static unsigned char *seeds; /* per page of R */
static volatile sig_atomic_t got_usr1, got_usr2, got_hup, got_ttin;
static int generation;

static uint64_t word(size_t page, size_t i, unsigned seed) {
	return (page * 512 + i) * 0x9E3779B97F4A7C15ULL ^ ((uint64_t)seed << 56) ^ 0x5bd1e995;
}

static void fill_page(size_t p, unsigned seed) {
	uint64_t *w = R + p * 512;
	for (size_t i = 0; i < 512; i++) w[i] = word(p, i, seed);
	seeds[p] = seed;
}

static int hostpid(void) {
	char buf[64];
	ssize_t n = readlink("/proc/self", buf, sizeof buf - 1);
	if (n <= 0) return getpid();
	buf[n] = 0;
	return atoi(buf);
}

static void report(const char *fmt, ...) {
	char path[4096], tmp[4200], line[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(line, sizeof line, fmt, ap);
	va_end(ap);
	int pid = hostpid();
	snprintf(path, sizeof path, "%s/report-%d", ctl, pid);
	snprintf(tmp, sizeof tmp, "%s.tmp", path);
	FILE *f = fopen(tmp, "w");
	if (!f) return;
	fprintf(f, "%s gen=%d\n", line, generation);
	fclose(f);
	rename(tmp, path);
}

static size_t verify(void) {
	size_t bad = 0;
	for (size_t p = 0; p < npages; p++) {
		uint64_t *w = R + p * 512;
		for (size_t i = 0; i < 512; i++)
			if (w[i] != word(p, i, seeds[p])) { bad++; break; }
	}
	for (size_t i = 0; i < 3 * PAGE; i++)
		if (N[i] != 0xAB) { bad++; break; }
	for (size_t i = 0; i < (4UL << 20) / 8; i++)
		if (G[i] != word(i / 512, i % 512, 9)) { bad++; break; }
	return bad;
}

static void on(int sig) {
	if (sig == SIGUSR1) got_usr1 = 1;
	if (sig == SIGUSR2) got_usr2 = 1;
	if (sig == SIGHUP) got_hup = 1;
	if (sig == SIGTTIN) got_ttin = 1;
}

static size_t nonzero(uint64_t *w, size_t words) {
	size_t n = 0;
	for (size_t i = 0; i < words; i++) n += w[i] != 0;
	return n;
}

static void grow(void) {
	size_t extra = 16UL << 20;
	uint64_t *r2 = mremap(R, rlen, rlen + extra, MREMAP_MAYMOVE);
	if (r2 == MAP_FAILED) { report("grow ok=0 err=%d", errno); return; }
	int moved = r2 != R;
	R = r2;
	size_t nz = nonzero(R + rlen / 8, extra / 8);
	size_t bad = verify();
	/* Shrink back so the next verify and dump see the same layout size. */
	uint64_t *r3 = mremap(R, rlen + extra, rlen, 0);
	if (r3 == MAP_FAILED) { report("grow ok=0 shrink_err=%d", errno); return; }
	long inplace_nz = -1;
	uint64_t *g2 = mremap(G, 4UL << 20, (4UL << 20) + extra, 0);
	if (g2 != MAP_FAILED) {
		inplace_nz = (long)nonzero(G + (4UL << 20) / 8, extra / 8);
		mremap(G, (4UL << 20) + extra, 4UL << 20, 0);
	}
	report("grow ok=%d nonzero=%zu moved=%d inplace_nonzero=%ld bad=%zu", nz == 0 && inplace_nz <= 0 && bad == 0, nz, moved, inplace_nz, bad);
}

int main(int argc, char **argv) {
	if (argc < 4) { fprintf(stderr, "usage: memtest CTLDIR HEAP_MIB CHILDREN\n"); return 2; }
	ctl = argv[1];
	rlen = (size_t)atoi(argv[2]) << 20;
	int children = atoi(argv[3]);
	npages = rlen / PAGE;
	seeds = malloc(npages);
	/* R then N right after it; N differs in flags (NORESERVE) so the kernel keeps two VMAs. */
	unsigned char *res = mmap(NULL, rlen + 3 * PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	R = mmap(res, rlen, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
	N = mmap(res + rlen, 3 * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
	memset(N, 0xAB, 3 * PAGE);
	for (size_t p = 0; p < npages; p++) fill_page(p, 1);
	/* G with 64 MiB of free address space after it. */
	unsigned char *gres = mmap(NULL, (68UL << 20), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	G = mmap(gres, 4UL << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0);
	munmap(gres + (4UL << 20), 64UL << 20);
	for (size_t i = 0; i < (4UL << 20) / 8; i++) G[i] = word(i / 512, i % 512, 9);

	W = mmap(NULL, 2 * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (W == MAP_FAILED || madvise((void *)W, 2 * PAGE, MADV_WIPEONFORK) != 0) { perror("wipeonfork"); return 1; }

	struct sigaction sa = {0};
	sa.sa_handler = on;
	sigaction(SIGUSR1, &sa, NULL);
	sigaction(SIGUSR2, &sa, NULL);
	sigaction(SIGHUP, &sa, NULL);
	sigaction(SIGTTIN, &sa, NULL);
	sigset_t block, old;
	sigemptyset(&block);
	sigaddset(&block, SIGUSR1);
	sigaddset(&block, SIGUSR2);
	sigaddset(&block, SIGHUP);
	sigaddset(&block, SIGTTIN);
	sigprocmask(SIG_BLOCK, &block, &old);

	int depth = argc > 4 ? atoi(argv[4]) : 1;
	for (int c = 0; c < children; c++) {
		if (fork() == 0) {
			for (size_t p = 0; p < 10 && p < npages; p++) fill_page(p, 2);
			/* A chain below the child: grandchildren see the child's pages. */
			for (int d = 1; d < depth; d++)
				if (fork() != 0) break;
			break;
		}
	}
	/* fork() wiped W in a child: every process sets it again. */
	W[0] = 0x5eed5eed;
	char ready[4096];
	snprintf(ready, sizeof ready, "%s/ready-%d", ctl, hostpid());
	close(open(ready, O_CREAT | O_WRONLY, 0644));
	for (;;) {
		sigsuspend(&old);
		if (got_usr1) {
			got_usr1 = 0;
			size_t bad = verify();
			report("verify ok=%d bad=%zu wipe=%llu wipe_addr=%lx", bad == 0, bad, (unsigned long long)W[0], (unsigned long)W);
		}
		if (got_hup) {
			got_hup = 0;
			generation++;
			for (size_t p = 10; p < 20 && p < npages; p++) fill_page(p, 3);
			report("dirty ok=1 pages=10");
		}
		if (got_ttin) {
			got_ttin = 0;
			generation++;
			for (size_t p = 0; p < npages; p += 2) fill_page(p, 4);
			report("dirty ok=1 pages=%zu", npages / 2);
		}
		if (got_usr2) {
			got_usr2 = 0;
			grow();
		}
	}
}
