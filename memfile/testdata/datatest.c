// datatest: a program whose .data is a large initialised array, for the
// tests of converting dirty private file mappings. Usage: datatest CTLDIR
// DIRTY_PAGES. Built with -I pointing at a generated datainit.h that defines
// DATA_INIT, a string literal of DATA_SIZE bytes: byte i is expect(i).
// With a third argument DATAFILE, it also maps that file MAP_PRIVATE
// read-write and writes its first page (a data file, not a program).
//
// At start it rewrites the first DIRTY_PAGES pages (4 KiB units of the array)
// with seed 1, so the dump holds those and the file the rest. Signals:
//   SIGUSR1  verify the whole array        -> "verify ok=1 bad=0"
//   SIGHUP   rewrite pages [0,10) with seed 3 and the last 10 pages with
//            seed 2 (pages still clean in the file) -> "dirty ok=1"
// Reports go to CTLDIR/report-<host pid>, readiness to CTLDIR/ready-<host pid>.
#define _GNU_SOURCE
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "datainit.h"

#define PAGE 4096UL
#define NPAGES (DATA_SIZE / PAGE)

unsigned char data[DATA_SIZE] = DATA_INIT;
static unsigned char seeds[NPAGES]; /* .bss: 0 = as in the file */
static const char *ctl;
static volatile sig_atomic_t got_usr1, got_hup;

static unsigned char expect(size_t i, unsigned seed) {
	unsigned char b = (unsigned char)(((uint32_t)i * 2654435761u) >> 24) ^ (unsigned char)(i >> 12);
	return seed ? b ^ (unsigned char)(0x5A + seed) : b;
}

static void fill(size_t p, unsigned seed) {
	for (size_t i = p * PAGE; i < (p + 1) * PAGE; i++) data[i] = expect(i, seed);
	seeds[p] = seed;
}

static int hostpid(void) {
	char buf[64];
	ssize_t n = readlink("/proc/self", buf, sizeof buf - 1);
	if (n <= 0) return getpid();
	buf[n] = 0;
	return atoi(buf);
}

static void report(const char *line) {
	char path[4096], tmp[4200];
	snprintf(path, sizeof path, "%s/report-%d", ctl, hostpid());
	snprintf(tmp, sizeof tmp, "%s.tmp", path);
	FILE *f = fopen(tmp, "w");
	if (!f) return;
	fprintf(f, "%s\n", line);
	fclose(f);
	rename(tmp, path);
}

static void on(int sig) {
	if (sig == SIGUSR1) got_usr1 = 1;
	if (sig == SIGHUP) got_hup = 1;
}

int main(int argc, char **argv) {
	if (argc < 3) { fprintf(stderr, "usage: datatest CTLDIR DIRTY_PAGES\n"); return 2; }
	ctl = argv[1];
	size_t dirty = (size_t)atoi(argv[2]);
	for (size_t p = 0; p < dirty && p < NPAGES; p++) fill(p, 1);
	if (argc > 3) {
		int fd = open(argv[3], O_RDWR);
		unsigned char *m = fd < 0 ? MAP_FAILED : mmap(NULL, 4 * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
		if (m == MAP_FAILED) { perror("datafile"); return 1; }
		memset(m, 0x77, PAGE);
	}

	struct sigaction sa = {0};
	sa.sa_handler = on;
	sigaction(SIGUSR1, &sa, NULL);
	sigaction(SIGHUP, &sa, NULL);
	sigset_t block, old;
	sigemptyset(&block);
	sigaddset(&block, SIGUSR1);
	sigaddset(&block, SIGHUP);
	sigprocmask(SIG_BLOCK, &block, &old);

	char ready[4096];
	snprintf(ready, sizeof ready, "%s/ready-%d", ctl, hostpid());
	close(open(ready, O_CREAT | O_WRONLY, 0644));
	for (;;) {
		sigsuspend(&old);
		if (got_usr1) {
			got_usr1 = 0;
			size_t bad = 0, first = (size_t)-1;
			for (size_t i = 0; i < DATA_SIZE; i++)
				if (data[i] != expect(i, seeds[i / PAGE])) {
					if (!bad) first = i;
					bad++;
				}
			char line[256];
			snprintf(line, sizeof line, "verify ok=%d bad=%zu first=%zd", bad == 0, bad, (ssize_t)first);
			report(line);
		}
		if (got_hup) {
			got_hup = 0;
			for (size_t p = 0; p < 10; p++) fill(p, 3);
			for (size_t p = NPAGES - 10; p < NPAGES; p++) fill(p, 2);
			report("dirty ok=1");
		}
	}
}
