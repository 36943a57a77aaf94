// A small process tree for round-trip tests: a parent with a thread, a heap,
// an open file and a pipe, and a child that dirties part of the heap.
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

static void *spin(void *arg) { for (;;) pause(); return arg; }

int main(int argc, char **argv) {
	const char *ready = argv[1];
	size_t n = 4 << 20;
	unsigned char *heap = malloc(n);
	for (size_t i = 0; i < n; i++) heap[i] = (unsigned char)(i * 13);
	unsigned char *m = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	memset(m, 0x5a, 1 << 20);
	int fd = open("/proc/self/exe", O_RDONLY);
	int p[2];
	if (pipe(p) < 0) return 1;
	pthread_t t;
	pthread_create(&t, NULL, spin, NULL);
	if (fork() == 0) {
		memset(heap, 0x11, 4096 * 3);
		for (;;) pause();
	}
	int r = open(ready, O_CREAT | O_WRONLY, 0644);
	close(r);
	(void)fd;
	for (;;) pause();
}
