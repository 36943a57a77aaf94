/*
 * purgeloop: purges its memory all the time, as a busy allocator does, and
 * counts what a purge returns. It holds 64 pages of patterned anonymous
 * memory and, in a loop, purges a page with MADV_DONTNEED, checks that it
 * reads zeros and writes it again. Every 20 ms it prints
 *
 *   purges n=<calls> bad=<non-zero returns> enosys=<ENOSYS returns> stale=<pages not zero after a 0 return> first_bad=<errno name or ->
 *
 * counting from its start (a restored copy goes on counting from its
 * parent's numbers).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define PAGES 64
#define PG 4096

static long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

int main(void)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	unsigned char *mem = mmap(NULL, PAGES * PG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (mem == MAP_FAILED) {
		perror("mmap");
		return 1;
	}
	for (int i = 0; i < PAGES * PG; i++)
		mem[i] = (unsigned char)(i * 7 + 1);
	unsigned long n = 0, bad = 0, enosys = 0, stale = 0;
	const char *first_bad = "-";
	long next = now_ms();
	for (unsigned long k = 0;; k++) {
		unsigned char *p = mem + (k % PAGES) * PG;
		n++;
		if (madvise(p, PG, MADV_DONTNEED) != 0) {
			if (bad++ == 0)
				first_bad = strerrorname_np(errno);
			if (errno == ENOSYS)
				enosys++;
		} else {
			for (int i = 0; i < PG; i += 64)
				if (p[i] != 0) {
					stale++;
					break;
				}
		}
		/* Written again at once: a dump always finds the region holding
		 * data (the guard covers only ranges that hold data). */
		memset(p, (int)(k | 1), PG);
		if ((k & 63) == 0 && now_ms() >= next) {
			printf("purges n=%lu bad=%lu enosys=%lu stale=%lu first_bad=%s\n", n, bad, enosys, stale, first_bad);
			next = now_ms() + 20;
			usleep(1000);
		}
	}
}
