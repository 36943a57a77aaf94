// tiny: a two-process tree with known anonymous memory, dumped once by
// mkdumps.sh into tiny.tar.gz for memfile's root-free tests of the rewrite.
// Usage: tiny DIR  (writes DIR/ready-parent and DIR/ready-child, then sleeps)
//
// Memory, at fixed addresses so the tests can find it:
//   A  0x7e0000000000, 32 pages, private anonymous: page i holds byte i+1
//      everywhere. The child, a fork, rewrites pages 0..3 with 0xC0+i and
//      keeps the other 28 as the parent has them.
//   E  0x7e0000100000, 8 pages, private anonymous, never touched: no pages.
//   C  0x7e0000200000, 4 pages, the child's own (mapped after the fork):
//      page i holds byte 0xE0+i.
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define PAGE 4096UL

static void *map(unsigned long addr, unsigned long pages) {
	void *p = mmap((void *)addr, pages * PAGE, PROT_READ | PROT_WRITE,
		       MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE, -1, 0);
	if (p == MAP_FAILED) {
		perror("mmap");
		_exit(1);
	}
	return p;
}

static void ready(const char *dir, const char *who) {
	char path[4096];
	snprintf(path, sizeof(path), "%s/ready-%s", dir, who);
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
	if (fd >= 0)
		close(fd);
}

int main(int argc, char **argv) {
	if (argc != 2)
		return 2;
	unsigned char *a = map(0x7e0000000000UL, 32);
	map(0x7e0000100000UL, 8);
	for (unsigned long i = 0; i < 32; i++)
		memset(a + i * PAGE, (int)(i + 1), PAGE);
	pid_t pid = fork();
	if (pid < 0)
		return 1;
	if (pid == 0) {
		for (unsigned long i = 0; i < 4; i++)
			memset(a + i * PAGE, (int)(0xC0 + i), PAGE);
		unsigned char *c = map(0x7e0000200000UL, 4);
		for (unsigned long i = 0; i < 4; i++)
			memset(c + i * PAGE, (int)(0xE0 + i), PAGE);
		ready(argv[1], "child");
	} else {
		ready(argv[1], "parent");
	}
	for (;;)
		pause();
}
