// cheap: a glibc-malloc workload for LazyFork's fidelity tests and benchmarks.
//
// It fills a heap (default 256 MiB: half in small blocks from the brk heap, half in
// 1 MiB blocks glibc mmaps) with patterns it can recompute, then ticks forever:
//   - every tick it checks a slice of the heap (so every stored pattern is checked
//     again and again), rewrites a few small blocks with a new generation, and every
//     few ticks grows the brk heap by a burst of blocks and shrinks it back (checking
//     calloc'd memory reads zeros);
//   - worker threads grow their own malloc arenas, check, free and malloc_trim them;
//   - SIGUSR1: check everything, including an mremap growth of a region that must
//     read zeros, and print a "verify" line; the growth of a region the kernel
//     merged with a small neighbour is reported (mremap_neighbour=) but not part
//     of ok=: LazyFork copies show the neighbour's bytes there (a known limit);

//   - SIGUSR2: write a new random marker into the heap and rewrite block 0, print
//     a "marker" line (a copy's write must be invisible to every other copy).
//
// Output (line buffered): "ready ...", "tick N bad=B", "verify tick=N ok=0|1 ...",
// "marker tick=N value=V".
//
// With -q (quiet, for benchmarks) there are no threads and no churn: each tick reads
// a few dozen random pages of the heap and writes one page of a 4 MiB scratch area
// (a different page each tick, so a copy gains one private page per tick).
//
// Usage: cheap [-q] [-m heapMiB] [-t tickMs] [-c checkKiBPerTick] [-T threads]
#define _GNU_SOURCE
#include <errno.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PAGE 4096UL
#define BIG (1UL << 20)

struct block {
	uint64_t *p;
	size_t words;
	uint64_t gen;
};

static struct block *blocks;
static size_t nblocks, heap_bytes;
static uint64_t *marker;            // a heap page holding the marker
static uint64_t marker_value;       // what this process last wrote there
static _Atomic uint64_t bad;        // pattern mismatches seen by anyone
static _Atomic uint64_t calloc_bad; // calloc'd words that were not zero
static volatile sig_atomic_t want_verify, want_marker;

static inline uint64_t mix(uint64_t x) {
	x ^= x >> 31;
	x *= 0x7fb5d329728ea185ULL;
	x ^= x >> 27;
	x *= 0x81dadef4bc2dd44dULL;
	x ^= x >> 33;
	return x;
}

static void fill(uint64_t *p, size_t words, uint64_t id, uint64_t gen) {
	uint64_t seed = mix(id * 0x9e3779b97f4a7c15ULL + gen) | 1;
	for (size_t i = 0; i < words; i++)
		p[i] = seed + i * 0xd6e8feb86659fd93ULL;
}

// check returns the number of words that differ from the pattern.
static uint64_t check(const uint64_t *p, size_t words, uint64_t id, uint64_t gen) {
	uint64_t seed = mix(id * 0x9e3779b97f4a7c15ULL + gen) | 1, n = 0;
	for (size_t i = 0; i < words; i++)
		n += p[i] != seed + i * 0xd6e8feb86659fd93ULL;
	return n;
}

static uint64_t nonzero(const void *v, size_t bytes) {
	const uint64_t *p = v;
	uint64_t n = 0;
	for (size_t i = 0; i < bytes / 8; i++)
		n += p[i] != 0;
	return n;
}

static uint64_t rnd_state;
static uint64_t rnd(void) { return mix(++rnd_state); }

static void new_gen(size_t i) {
	struct block *b = &blocks[i];
	b->gen++;
	fill(b->p, b->words, i, b->gen);
}

// Small blocks come and go: free, then malloc again with a size that may differ.
static void churn(size_t i) {
	struct block *b = &blocks[i];
	uint64_t n = check(b->p, b->words, i, b->gen);
	if (n)
		atomic_fetch_add(&bad, n);
	free(b->p);
	size_t bytes = 4096 + (rnd() % 15) * 4096;
	b->p = malloc(bytes);
	b->words = bytes / 8;
	b->gen++;
	fill(b->p, b->words, i, b->gen);
}

// brk_burst grows the main arena by a few MiB of small calloc'd blocks (which must
// read zeros), checks them, and frees them in reverse so the top is trimmed.
static void brk_burst(void) {
	enum { N = 256 };
	static uint64_t *p[N];
	void *before = sbrk(0);
	for (int i = 0; i < N; i++) {
		size_t bytes = 8192 + (i % 4) * 4096;
		p[i] = calloc(1, bytes);
		uint64_t nz = nonzero(p[i], bytes);
		if (nz)
			atomic_fetch_add(&calloc_bad, nz);
		fill(p[i], bytes / 8, 1000000 + i, 7);
	}
	for (int i = 0; i < N; i++) {
		size_t bytes = 8192 + (i % 4) * 4096;
		uint64_t n = check(p[i], bytes / 8, 1000000 + i, 7);
		if (n)
			atomic_fetch_add(&bad, n);
	}
	for (int i = N - 1; i >= 0; i--)
		free(p[i]);
	malloc_trim(0);
	(void)before;
}

// Worker threads have their own arenas: grow to ~12 MiB, check, free, trim.
static void *worker(void *arg) {
	uint64_t id = (uintptr_t)arg * 100000000ULL, round = 0;
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, SIGUSR1);
	sigaddset(&s, SIGUSR2);
	pthread_sigmask(SIG_BLOCK, &s, NULL);
	enum { N = 384 };
	uint64_t *p[N];
	size_t sz[N];
	for (;;) {
		round++;
		for (int i = 0; i < N; i++) {
			sz[i] = 8192 + ((round + i) % 8) * 4096;
			if (i % 3 == 0) {
				p[i] = calloc(1, sz[i]);
				uint64_t nz = nonzero(p[i], sz[i]);
				if (nz)
					atomic_fetch_add(&calloc_bad, nz);
			} else {
				p[i] = malloc(sz[i]);
			}
			fill(p[i], sz[i] / 8, id + i, round);
		}
		struct timespec ts = {0, 50 * 1000 * 1000};
		nanosleep(&ts, NULL);
		for (int i = 0; i < N; i++) {
			uint64_t n = check(p[i], sz[i] / 8, id + i, round);
			if (n)
				atomic_fetch_add(&bad, n);
		}
		for (int i = N - 1; i >= 0; i--)
			free(p[i]);
		malloc_trim(0);
		nanosleep(&ts, NULL);
	}
	return NULL;
}

// The mremap regions: "lone" has a guard gap after it; "merged" has a small
// neighbour mapped right after it, which the kernel merges into one VMA.
#define MR_SIZE (1UL << 20)
#define NB_SIZE (3 * PAGE)
static uint64_t *lone, *merged, *neighbour;

static uint64_t *map_at(void *hint, size_t len, int fixed) {
	void *p = mmap(hint, len, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS | (fixed ? MAP_FIXED_NOREPLACE : 0), -1, 0);
	if (p == MAP_FAILED) {
		perror("mmap");
		exit(2);
	}
	return p;
}

static void setup_mremap(void) {
	// Reserve room, then carve: [lone][gap][merged][neighbour][gap].
	char *base = mmap(NULL, 8 * MR_SIZE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	munmap(base, 8 * MR_SIZE);
	lone = map_at(base, MR_SIZE, 1);
	merged = map_at(base + 3 * MR_SIZE, MR_SIZE, 1);
	neighbour = map_at(base + 4 * MR_SIZE, NB_SIZE, 1);
	fill(lone, MR_SIZE / 8, 2000001, 1);
	fill(merged, MR_SIZE / 8, 2000002, 1);
	fill(neighbour, NB_SIZE / 8, 2000003, 1);
}

// grow_check doubles a region with mremap (it may move), checks the old half kept
// its pattern and the new half reads zeros, then shrinks it back. Returns nonzero
// words in the new half, or bad words in the old half (as a negative count).
static long grow_check(uint64_t **region, uint64_t id) {
	uint64_t *p = mremap(*region, MR_SIZE, 2 * MR_SIZE, MREMAP_MAYMOVE);
	if (p == MAP_FAILED)
		return -1000000;
	long r = 0;
	uint64_t old = check(p, MR_SIZE / 8, id, 1);
	uint64_t nz = nonzero((char *)p + MR_SIZE, MR_SIZE);
	if (old)
		r = -(long)old;
	else
		r = (long)nz;
	uint64_t *q = mremap(p, 2 * MR_SIZE, MR_SIZE, 0);
	if (q == MAP_FAILED)
		return -1000001;
	*region = q;
	return r;
}

static const char *mr_word(long r) {
	static char buf[2][64];
	static int k;
	k ^= 1;
	if (r == 0)
		return "ok";
	if (r > 0)
		snprintf(buf[k], sizeof buf[k], "nonzero_words=%ld", r);
	else
		snprintf(buf[k], sizeof buf[k], "old_half_bad=%ld", -r);
	return buf[k];
}

static void verify(uint64_t tick) {
	struct timespec a, b;
	clock_gettime(CLOCK_MONOTONIC, &a);
	uint64_t n = 0, checked = 0;
	for (size_t i = 0; i < nblocks; i++) {
		n += check(blocks[i].p, blocks[i].words, i, blocks[i].gen);
		checked += blocks[i].words * 8;
	}
	n += check(neighbour, NB_SIZE / 8, 2000003, 1);
	long lr = grow_check(&lone, 2000001);
	long mr = grow_check(&merged, 2000002);
	n += check(neighbour, NB_SIZE / 8, 2000003, 1);
	if (*marker != marker_value)
		n++;
	atomic_fetch_add(&bad, n);
	clock_gettime(CLOCK_MONOTONIC, &b);
	uint64_t total_bad = atomic_load(&bad), cb = atomic_load(&calloc_bad);
	// The merged-neighbour growth is reported but not part of ok: no memory-file
	// layout can hide a neighbour the kernel merged into the VMA before the dump
	// (the boundary is nowhere in the dump; see memfile's package doc).
	int ok = total_bad == 0 && cb == 0 && lr == 0;
	printf("verify tick=%llu ok=%d checked=%llu bad=%llu calloc_bad=%llu marker=%llu "
	       "mremap=%s mremap_neighbour=%s ms=%ld\n",
	       (unsigned long long)tick, ok, (unsigned long long)checked,
	       (unsigned long long)total_bad, (unsigned long long)cb,
	       (unsigned long long)*marker, mr_word(lr), mr_word(mr),
	       (long)((b.tv_sec - a.tv_sec) * 1000 + (b.tv_nsec - a.tv_nsec) / 1000000));
}

static void on_usr1(int s) { (void)s; want_verify = 1; }
static void on_usr2(int s) { (void)s; want_marker = 1; }

int main(int argc, char **argv) {
	long heap_mib = 256, tick_ms = 100, check_kib = 1024, threads = 2;
	int c, quiet = 0;
	while ((c = getopt(argc, argv, "qm:t:c:T:")) != -1) {
		switch (c) {
		case 'q': quiet = 1; threads = 0; break;
		case 'm': heap_mib = atol(optarg); break;
		case 't': tick_ms = atol(optarg); break;
		case 'c': check_kib = atol(optarg); break;
		case 'T': threads = atol(optarg); break;
		default:
			fprintf(stderr, "usage: %s [-q] [-m heapMiB] [-t tickMs] [-c checkKiBPerTick] [-T threads]\n", argv[0]);
			return 2;
		}
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	struct sigaction sa = {0};
	sa.sa_handler = on_usr1;
	sigaction(SIGUSR1, &sa, NULL);
	sa.sa_handler = on_usr2;
	sigaction(SIGUSR2, &sa, NULL);
	rnd_state = 12345;

	// Half the heap in 1 MiB (mmapped) blocks, half in small brk blocks.
	heap_bytes = (size_t)heap_mib << 20;
	size_t big = heap_bytes / 2 / BIG, cap = big + heap_bytes / 2 / 4096 + 16;
	blocks = calloc(cap, sizeof *blocks);
	size_t small_bytes = 0;
	for (size_t i = 0; i < big; i++) {
		blocks[nblocks].words = BIG / 8;
		blocks[nblocks].p = malloc(BIG);
		nblocks++;
	}
	while (small_bytes + 61440 <= heap_bytes / 2) {
		size_t bytes = 4096 + (rnd() % 15) * 4096;
		blocks[nblocks].words = bytes / 8;
		blocks[nblocks].p = malloc(bytes);
		small_bytes += bytes;
		nblocks++;
	}
	for (size_t i = 0; i < nblocks; i++)
		fill(blocks[i].p, blocks[i].words, i, blocks[i].gen);
	marker = calloc(1, PAGE);
	setup_mremap();
	for (long i = 0; i < threads; i++) {
		pthread_t t;
		pthread_create(&t, NULL, worker, (void *)(uintptr_t)(i + 1));
	}
	printf("ready pid=%d heap=%zu blocks=%zu\n", getpid(), heap_bytes, nblocks);

	size_t cursor = 0;
	uint64_t per_tick = (uint64_t)check_kib * 1024;
	volatile uint64_t sink = 0;
	uint64_t *scratch = NULL;
	if (quiet) {
		scratch = malloc(4UL << 20);
		memset(scratch, 0x5a, 4UL << 20);
	}
	for (uint64_t tick = 1; quiet; tick++) {
		for (int k = 0; k < 40; k++) {
			struct block *b = &blocks[rnd() % nblocks];
			sink += b->p[(rnd() % (b->words * 8 / PAGE)) * (PAGE / 8)];
		}
		scratch[(tick % 1024) * (PAGE / 8)] = tick;
		printf("tick %llu bad=%llu\n", (unsigned long long)tick, (unsigned long long)atomic_load(&bad));
		struct timespec ts = {tick_ms / 1000, (tick_ms % 1000) * 1000000};
		while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
			if (want_verify || want_marker)
				break;
		}
		if (want_marker) {
			want_marker = 0;
			marker_value = (rnd() >> 1) | 1;
			*marker = marker_value;
			printf("marker tick=%llu value=%llu\n", (unsigned long long)tick,
			       (unsigned long long)marker_value);
		}
		if (want_verify) {
			want_verify = 0;
			verify(tick);
		}
	}
	for (uint64_t tick = 1;; tick++) {
		// Check a slice of the heap, wrapping around.
		uint64_t done = 0, n = 0;
		while (done < per_tick && nblocks) {
			struct block *b = &blocks[cursor];
			n += check(b->p, b->words, cursor, b->gen);
			done += b->words * 8;
			cursor = (cursor + 1) % nblocks;
		}
		if (n)
			atomic_fetch_add(&bad, n);
		// Small blocks sit after the big ones: churn a few of them.
		for (int k = 0; k < 4 && nblocks > big; k++)
			churn(big + rnd() % (nblocks - big));
		if (tick % 5 == 0)
			brk_burst();
		printf("tick %llu bad=%llu\n", (unsigned long long)tick,
		       (unsigned long long)(atomic_load(&bad) + atomic_load(&calloc_bad)));
		struct timespec ts = {tick_ms / 1000, (tick_ms % 1000) * 1000000};
		while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {
			if (want_verify || want_marker)
				break;
		}
		if (want_marker) {
			want_marker = 0;
			marker_value = (rnd() >> 1) | 1;
			*marker = marker_value;
			new_gen(0);
			printf("marker tick=%llu value=%llu\n", (unsigned long long)tick,
			       (unsigned long long)marker_value);
		}
		if (want_verify) {
			want_verify = 0;
			verify(tick);
		}
	}
}
