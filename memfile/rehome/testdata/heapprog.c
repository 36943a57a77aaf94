// heapprog: a test workload for memfile/rehome. It holds a per-page pattern
// in a large malloc'd block, in brk memory and in small mallocs, runs
// threads that sit in blocking calls (nanosleep, a futex through
// pthread_cond_timedwait, a read on an empty pipe), and answers commands on
// stdin (its main thread sits in poll):
//   verify      -> "ok ticks=N t1=A t2=B errs=E" or "BAD ..."; E counts
//                  blocking calls that failed (EINTR or worse): none should
//   mark        -> writes a marker into the first heap page -> "marked"
//   madv A L    -> madvise(A, L, MADV_DONTNEED) -> "madv 0" or "madv ERRNO"
//   guard A L   -> madvise(A, L, MADV_GUARD_INSTALL) -> "guard 0" or "guard ERRNO"
//   unguard A L -> madvise(A, L, MADV_GUARD_REMOVE) -> "unguard 0" or "unguard ERRNO"
//   spread S O  -> flips word 1 of heap pages O, O+S, O+2S... (verify
//                  expects them flipped) -> "spread N" (pages written)
//   quit
// It prints "heap ADDR LEN", "brk ADDR LEN", "spare ADDR LEN" and "ready".
//   traps       -> "traps N": the SIGTRAPs its handler took
// HEAPPROG_SIGTRAP=catch installs a SIGTRAP handler, =ignore ignores it.
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static uint64_t *heap;
static size_t heap_len;
static uint64_t *brkmem;
static size_t brk_len = 1 << 20;
static uint64_t *small[1000];
static int marked;
static unsigned char *flips; // per heap page: word 1 flipped
static volatile unsigned long ticks, t1, t2, t3, errs;

static uint64_t pat(uint64_t page, uint64_t word) { return (page << 20) ^ (word * 0x9e3779b97f4a7c15ull) ^ 0x5a5a; }

static void fill(uint64_t *p, size_t len, uint64_t tag) {
	size_t words = len / 8;
	for (size_t i = 0; i < words; i++) p[i] = pat(tag + i / 512, i % 512);
}

static long check(uint64_t *p, size_t len, uint64_t tag) {
	size_t words = len / 8;
	for (size_t i = 0; i < words; i++)
		if (p[i] != pat(tag + i / 512, i % 512)) return (long)i;
	return -1;
}

// check_heap is check of the heap with the spread flips.
static long check_heap(void) {
	size_t words = heap_len / 8;
	for (size_t i = marked ? 512 : 0; i < words; i++) {
		uint64_t want = pat(i / 512, i % 512);
		if (i % 512 == 1 && flips[i / 512]) want ^= 0xff;
		if (heap[i] != want) return (long)i;
	}
	return -1;
}

static void *sleeper(void *a) {
	(void)a;
	struct timespec ts = {0, 5000000};
	for (;;) { if (nanosleep(&ts, NULL)) errs++; t1++; }
	return NULL;
}

static void *waiter(void *a) {
	(void)a;
	pthread_mutex_t m = PTHREAD_MUTEX_INITIALIZER;
	pthread_cond_t c = PTHREAD_COND_INITIALIZER;
	pthread_mutex_lock(&m);
	for (;;) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		ts.tv_nsec += 7000000;
		if (ts.tv_nsec >= 1000000000) { ts.tv_sec++; ts.tv_nsec -= 1000000000; }
		pthread_cond_timedwait(&c, &m, &ts);
		t2++;
	}
	return NULL;
}

static int pfd[2];
static void *reader(void *a) {
	(void)a;
	char b;
	for (;;) { if (read(pfd[0], &b, 1) == 1) t3++; else errs++; }
	return NULL;
}

static volatile sig_atomic_t traps;
static void on_trap(int sig) { (void)sig; traps++; }

int main(int argc, char **argv) {
	size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 64;
	const char *trap = getenv("HEAPPROG_SIGTRAP");
	if (trap && !strcmp(trap, "catch")) signal(SIGTRAP, on_trap);
	if (trap && !strcmp(trap, "ignore")) signal(SIGTRAP, SIG_IGN);
	setvbuf(stdout, NULL, _IOLBF, 0);
	heap_len = mib << 20;
	heap = malloc(heap_len);
	fill(heap, heap_len, 0);
	flips = calloc(heap_len / 4096, 1);
	brkmem = sbrk(brk_len);
	fill(brkmem, brk_len, 1 << 24);
	for (int i = 0; i < 1000; i++) { small[i] = malloc(100); memset(small[i], i & 0xff, 100); }
	// A region the madvise guard test leaves unguarded.
	void *spare = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	memset(spare, 1, 1 << 20);
	if (pipe(pfd)) return 1;
	pthread_t th;
	pthread_create(&th, NULL, sleeper, NULL);
	pthread_create(&th, NULL, waiter, NULL);
	pthread_create(&th, NULL, reader, NULL);
	printf("heap %p %zu\nbrk %p %zu\nspare %p %d\nready\n", (void *)heap, heap_len, (void *)brkmem, brk_len, spare, 1 << 20);
	char line[256];
	for (;;) {
		struct pollfd p = {0, POLLIN, 0};
		int n = poll(&p, 1, 10);
		ticks++;
		if (n < 0) errs++;
		if (n <= 0) continue;
		if (!fgets(line, sizeof line, stdin)) return 0;
		if (!strncmp(line, "verify", 6)) {
			long bad = check_heap();
			long badb = check(brkmem, brk_len, 1 << 24);
			int bads = -1;
			for (int i = 0; i < 1000 && bads < 0; i++)
				for (int j = 0; j < 100; j++)
					if (((unsigned char *)small[i])[j] != (i & 0xff)) { bads = i; break; }
			if (bad >= 0 || badb >= 0 || bads >= 0)
				printf("BAD heap=%ld brk=%ld small=%d\n", bad, badb, bads);
			else
				printf("ok ticks=%lu t1=%lu t2=%lu errs=%lu\n", ticks, t1, t2, errs);
		} else if (!strncmp(line, "mark", 4)) {
			heap[0] = 0xdeadbeefcafef00dull;
			marked = 1;
			printf("marked\n");
		} else if (!strncmp(line, "madv ", 5)) {
			unsigned long a, l;
			sscanf(line + 5, "%lx %lx", &a, &l);
			int r = madvise((void *)a, l, MADV_DONTNEED);
			printf("madv %d\n", r ? errno : 0);
		} else if (!strncmp(line, "guard ", 6)) {
			unsigned long a, l;
			sscanf(line + 6, "%lx %lx", &a, &l);
			int r = madvise((void *)a, l, 102 /* MADV_GUARD_INSTALL */);
			printf("guard %d\n", r ? errno : 0);
		} else if (!strncmp(line, "unguard ", 8)) {
			unsigned long a, l;
			sscanf(line + 8, "%lx %lx", &a, &l);
			int r = madvise((void *)a, l, 103 /* MADV_GUARD_REMOVE */);
			printf("unguard %d\n", r ? errno : 0);
		} else if (!strncmp(line, "spread ", 7)) {
			unsigned long st, o, n = 0;
			sscanf(line + 7, "%lu %lu", &st, &o);
			for (size_t pg = o; st && pg < heap_len / 4096; pg += st, n++) {
				heap[pg * 512 + 1] ^= 0xff;
				flips[pg] ^= 1;
			}
			printf("spread %lu\n", n);
		} else if (!strncmp(line, "traps", 5)) {
			printf("traps %d\n", (int)traps);
		} else if (!strncmp(line, "quit", 4)) {
			return 0;
		}
	}
}
