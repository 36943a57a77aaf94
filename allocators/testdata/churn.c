/*
 * churn: multi-threaded malloc/calloc/realloc/free churn with integrity checks.
 *
 * Every calloc'ed block is checked to be all zero; every block carries a
 * pattern that is checked before it is freed or reallocated (and the kept
 * prefix after a realloc). A reporter prints cumulative counts every
 * interval, so a restored copy keeps counting where its parent stopped:
 *
 *   churn t=<sec> ops=<n> callocs=<n> bad_calloc=<n> bad_pattern=<n>
 *
 * Usage: churn [-t threads] [-m MiB] [-i interval_ms] [-s seconds] [-y us]
 *   -m  working set per process (default 64 MiB), -s 0 runs until killed,
 *   -y  sleep that long after every 64 operations (keeps many copies on
 *       few cores responsive).
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

struct slot {
	uint64_t *p;
	size_t words;
	uint64_t tag;
};

static _Atomic uint64_t ops, callocs, bad_calloc, bad_pattern, ready;
static size_t per_thread_bytes;
static unsigned yield_us;

static uint64_t rnd(uint64_t *s)
{
	/* xorshift64* */
	*s ^= *s >> 12;
	*s ^= *s << 25;
	*s ^= *s >> 27;
	return *s * 2685821657736338717ULL;
}

/* Mostly small blocks, some medium, a few large enough for their own extents. */
static size_t pick_words(uint64_t *s)
{
	uint64_t r = rnd(s) % 100;
	size_t bytes;
	if (r < 60)
		bytes = 16 + rnd(s) % 1024;
	else if (r < 90)
		bytes = 1024 + rnd(s) % (64 << 10);
	else
		bytes = (64 << 10) + rnd(s) % (960 << 10);
	return (bytes + 7) / 8;
}

static void fill(uint64_t *p, size_t from, size_t words, uint64_t tag)
{
	for (size_t i = from; i < words; i++)
		p[i] = tag ^ (i * 0x9e3779b97f4a7c15ULL);
}

static int intact(const uint64_t *p, size_t words, uint64_t tag)
{
	for (size_t i = 0; i < words; i++)
		if (p[i] != (tag ^ (i * 0x9e3779b97f4a7c15ULL)))
			return 0;
	return 1;
}

static int zero(const uint64_t *p, size_t words)
{
	for (size_t i = 0; i < words; i++)
		if (p[i])
			return 0;
	return 1;
}

static void *worker(void *arg)
{
	uint64_t seed = 0x12345678ULL + (uintptr_t)arg * 0x1000193ULL;
	size_t nslots = per_thread_bytes / (66 << 10);
	if (nslots < 16)
		nslots = 16;
	struct slot *slots = calloc(nslots, sizeof(*slots));
	if (!slots) {
		perror("calloc slots");
		exit(1);
	}
	/* Fill the working set first, so a dump holds a full heap. */
	for (size_t i = 0; i < nslots; i++) {
		size_t w = pick_words(&seed);
		slots[i].p = malloc(w * 8);
		slots[i].words = w;
		slots[i].tag = rnd(&seed);
		fill(slots[i].p, 0, w, slots[i].tag);
	}
	atomic_fetch_add(&ready, 1);
	for (uint64_t n = 0;; n++) {
		struct slot *s = &slots[rnd(&seed) % nslots];
		if (!s->p) {
			size_t w = pick_words(&seed);
			s->tag = rnd(&seed);
			s->words = w;
			if (rnd(&seed) & 1) {
				s->p = calloc(w, 8);
				atomic_fetch_add_explicit(&callocs, 1, memory_order_relaxed);
				if (!zero(s->p, w))
					atomic_fetch_add(&bad_calloc, 1);
			} else {
				s->p = malloc(w * 8);
			}
			if (!s->p) {
				perror("alloc");
				exit(1);
			}
			fill(s->p, 0, w, s->tag);
		} else {
			if (!intact(s->p, s->words, s->tag))
				atomic_fetch_add(&bad_pattern, 1);
			if (rnd(&seed) % 10 < 3) {
				size_t w = pick_words(&seed);
				uint64_t *q = realloc(s->p, w * 8);
				if (!q) {
					perror("realloc");
					exit(1);
				}
				size_t keep = w < s->words ? w : s->words;
				if (!intact(q, keep, s->tag))
					atomic_fetch_add(&bad_pattern, 1);
				s->p = q;
				fill(q, keep, w, s->tag);
				s->words = w;
			} else {
				free(s->p);
				s->p = NULL;
			}
		}
		atomic_fetch_add_explicit(&ops, 1, memory_order_relaxed);
		if (yield_us && (n & 63) == 63)
			usleep(yield_us);
	}
	return NULL;
}

int main(int argc, char **argv)
{
	int threads = 2, opt;
	long mib = 64, interval_ms = 1000, seconds = 0;
	while ((opt = getopt(argc, argv, "t:m:i:s:y:")) != -1) {
		switch (opt) {
		case 't': threads = atoi(optarg); break;
		case 'm': mib = atol(optarg); break;
		case 'i': interval_ms = atol(optarg); break;
		case 's': seconds = atol(optarg); break;
		case 'y': yield_us = (unsigned)atoi(optarg); break;
		default:
			fprintf(stderr, "usage: %s [-t threads] [-m MiB] [-i interval_ms] [-s seconds] [-y us]\n", argv[0]);
			return 2;
		}
	}
	if (threads < 1 || mib < 1 || interval_ms < 1) {
		fprintf(stderr, "churn: bad arguments\n");
		return 2;
	}
	per_thread_bytes = (size_t)mib * (1 << 20) / threads;
	setvbuf(stdout, NULL, _IOLBF, 0);
	for (int i = 0; i < threads; i++) {
		pthread_t t;
		if (pthread_create(&t, NULL, worker, (void *)(uintptr_t)i)) {
			fprintf(stderr, "churn: pthread_create failed\n");
			return 1;
		}
	}
	while (atomic_load(&ready) < (uint64_t)threads)
		usleep(1000);
	printf("churn ready threads=%d mib=%ld\n", threads, mib);
	struct timespec start, now, d = {interval_ms / 1000, (interval_ms % 1000) * 1000000L};
	clock_gettime(CLOCK_MONOTONIC, &start);
	for (long t = 1;; t++) {
		nanosleep(&d, NULL);
		clock_gettime(CLOCK_MONOTONIC, &now);
		printf("churn t=%ld ops=%llu callocs=%llu bad_calloc=%llu bad_pattern=%llu\n",
		       (long)(now.tv_sec - start.tv_sec),
		       (unsigned long long)atomic_load(&ops), (unsigned long long)atomic_load(&callocs),
		       (unsigned long long)atomic_load(&bad_calloc), (unsigned long long)atomic_load(&bad_pattern));
		if (seconds && now.tv_sec - start.tv_sec >= seconds)
			return 0;
	}
}
