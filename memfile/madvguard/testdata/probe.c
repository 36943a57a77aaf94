/*
 * probe: holds 8 MiB of anonymous data and reports, every 100 ms, what
 * madvise does to it, from two threads:
 *
 *   probe in=<r> free=<r> out=<r> data=<ok|bad> own=<r> filters=<n> t2in=<r> t2own=<r> in_ns=<n> out_ns=<n>
 *
 * in/free: MADV_DONTNEED / MADV_FREE on a page of the region; out: DONTNEED
 * on a fresh mapping; data: the region still holds its bytes wherever madvise
 * failed; own: errno of sched_get_priority_max(77), which -f blocks with its
 * own filter (a container profile stand-in); t2own the same from thread 2,
 * which with -F adds one more filter of its own (chains differ per thread).
 * With -c, every report also starts a short-lived thread whose DONTNEED
 * inside the region is reported as t3in (threads born after a restore).
 * in_ns/out_ns: mean time of a MADV_DONTNEED call on a just-written page
 * inside the region / in a fresh mapping (100 calls each per report).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define REGION (8 << 20)
static unsigned char *region;
static volatile const char *t2in = "-", *t2own = "-";

static const char *res(int r) { return r == 0 ? "ok" : strerrorname_np(errno); }

static void own_filter(int nr, int err)
{
	struct sock_filter f[] = {
		BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
		BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, nr, 0, 1),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | err),
		BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
	};
	struct sock_fprog p = {.len = 4, .filter = f};
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &p)) {
		perror("seccomp");
		exit(1);
	}
}

static const char *own(void)
{
	return syscall(SYS_sched_get_priority_max, 77) < 0 ? strerrorname_np(errno) : "ok";
}

static int extra, spawn;

static void *thread3(void *arg)
{
	unsigned char *p = region + (5 << 20);
	int r = madvise(p, 4096, MADV_DONTNEED);
	*(const char **)arg = res(r);
	memset(p, 0xa5, 4096);
	return NULL;
}

static void *thread2(void *arg)
{
	(void)arg;
	if (extra)
		own_filter(SYS_getpriority, EDOM);
	for (;;) {
		unsigned char *p = region + (6 << 20);
		int r = madvise(p, 4096, MADV_DONTNEED);
		t2in = res(r);
		t2own = own();
		memset(p, 0xa5, 4096);
		usleep(50000);
	}
	return NULL;
}

static int filters(void)
{
	char line[256];
	int n = -1;
	FILE *f = fopen("/proc/self/status", "r");
	while (f && fgets(line, sizeof line, f))
		if (sscanf(line, "Seccomp_filters: %d", &n) == 1)
			break;
	if (f)
		fclose(f);
	return n;
}

static long long now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Mean ns of madvise(DONTNEED) on a just-written page, over n pages of base. */
static long long cost(unsigned char *base, int n)
{
	long long total = 0;
	for (int i = 0; i < n; i++) {
		unsigned char *p = base + (size_t)i * 4096;
		p[0] = 0xa5;
		long long t0 = now_ns();
		madvise(p, 4096, MADV_DONTNEED);
		total += now_ns() - t0;
		memset(p, 0xa5, 4096);
	}
	return total / n;
}

int main(int argc, char **argv)
{
	int opt;
	while ((opt = getopt(argc, argv, "fFc")) != -1) {
		if (opt == 'c')
			spawn = 1;
		if (opt == 'f')
			own_filter(SYS_sched_get_priority_max, EXFULL);
		if (opt == 'F')
			extra = 1;
	}
	setvbuf(stdout, NULL, _IOLBF, 0);
	region = mmap(NULL, REGION, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (region == MAP_FAILED)
		return 1;
	memset(region, 0xa5, REGION);
	pthread_t t;
	pthread_create(&t, NULL, thread2, NULL);
	printf("probe ready region=%p\n", (void *)region);
	for (;;) {
		unsigned char *p = region + (4 << 20);
		int in = madvise(p, 4096, MADV_DONTNEED);
		const char *rin = res(in);
		int okdata = in != 0 ? p[100] == 0xa5 : p[100] == 0;
		memset(p, 0xa5, 4096);
		int fr = madvise(region, 4096, MADV_FREE);
		const char *rfree = res(fr);
		memset(region, 0xa5, 4096);
		unsigned char *o = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		memset(o, 1, 1 << 20);
		const char *rout = res(madvise(o, 1 << 20, MADV_DONTNEED));
		long long in_ns = cost(region + (2 << 20), 100), out_ns = cost(o, 100);
		munmap(o, 1 << 20);
		const char *t3in = "-";
		if (spawn) {
			pthread_t t3;
			pthread_create(&t3, NULL, thread3, &t3in);
			pthread_join(t3, NULL);
		}
		printf("probe in=%s free=%s out=%s data=%s own=%s filters=%d t2in=%s t2own=%s t3in=%s in_ns=%lld out_ns=%lld\n",
		       rin, rfree, rout, okdata ? "ok" : "bad", own(), filters(), t2in, t2own, t3in, in_ns, out_ns);
		usleep(100000);
	}
}
