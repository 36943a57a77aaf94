/*
 * lazyfork-criu-proxy: installed as `criu` and `tar` (one binary, two names)
 * in criu-proxy/ beside the shim binaries; the LazyFork shim puts that
 * directory first on the PATH of its runc calls (shim/criuproxy.go), which
 * runc and CRIU inherit. It dispatches on the name it was run by.
 *
 * criu: runc asks CRIU for its version (`criu swrk N`, one VERSION request on
 * the AF_UNIX SOCK_SEQPACKET socket N) before every checkpoint and restore,
 * and then runs CRIU again for the real request. For `criu swrk N` the proxy
 * peeks at the request (MSG_PEEK: nothing is consumed) and, if it is a
 * VERSION request without keep_open, answers with the real CRIU's answer that
 * the shim passes in LAZYFORK_CRIU_VERSION_ANSWER (hex) and exits 0, as CRIU
 * does. It answers only if the real CRIU (LAZYFORK_CRIU_REAL) still has the
 * identity the answer came from (LAZYFORK_CRIU_REAL_ID,
 * device:inode:size:mtime-in-ns): an upgraded CRIU is asked again.
 *
 * tar: CRIU dumps every tmpfs mount with `tar --create --gzip ...`, the
 * mount's root on standard input. For exactly those arguments and an empty
 * directory on fd 0 the proxy writes what GNU tar would archive (one "./"
 * directory entry, GNU format, numeric owner) gzipped with a stored block,
 * and exits 0.
 *
 * Anything else (another command line or request, an error before the
 * request is consumed): it executes the real program (LAZYFORK_CRIU_REAL,
 * LAZYFORK_TAR_REAL, or else the first of that name on PATH that is not this
 * binary) with the same arguments, environment and file descriptors.
 *
 * Only root sets the shim's environment (runc runs this as root), so the
 * environment is trusted; the shim checks ownership of everything it names.
 * Static and libc-only, so an exec costs little more than CRIU's own start.
 * Built with -DLAZYFORK_PROXY_TEST it is the decoder's test driver instead
 * (internal/criuproxy's tests).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#define REQ_VERSION 10 /* CRIU_REQ_TYPE__VERSION (images/rpc.proto) */
#define FIELD_TYPE 1   /* criu_req.type */
#define FIELD_KEEP 4   /* criu_req.keep_open */
#define MAX_MSG (64 << 10)

static unsigned char buf[MAX_MSG];

/* A protobuf varint: its length, or 0 if bad. Like Go's decoder: at most 10
 * bytes, the tenth at most 1. */
static size_t uvarint(const unsigned char *b, size_t len, uint64_t *v)
{
	*v = 0;
	for (size_t i = 0; i < len && i < 10; i++) {
		if (i == 9 && b[i] > 1)
			return 0;
		*v |= (uint64_t)(b[i] & 0x7f) << (7 * i);
		if (b[i] < 0x80)
			return i + 1;
	}
	return 0;
}

/* Reads the type and keep_open of a marshalled criu_req (the last of a field
 * given twice counts, as in protobuf). 0 if it is a well-formed request. */
static int parse_req(const unsigned char *b, size_t len, uint64_t *type, int *keep)
{
	int has_type = 0;
	*keep = 0;
	while (len > 0) {
		uint64_t key, v;
		size_t n = uvarint(b, len, &key), skip;
		if (!n)
			return -1;
		b += n, len -= n;
		uint64_t field = key >> 3, wire = key & 7;
		if (field == 0)
			return -1;
		if ((field == FIELD_TYPE || field == FIELD_KEEP) && wire != 0)
			return -1;
		switch (wire) {
		case 0:
			if (!(skip = uvarint(b, len, &v)))
				return -1;
			if (field == FIELD_TYPE)
				*type = v, has_type = 1;
			else if (field == FIELD_KEEP)
				*keep = v != 0;
			break;
		case 1: skip = 8; break;
		case 5: skip = 4; break;
		case 2:
			if (!(n = uvarint(b, len, &v)) || v > len - n)
				return -1;
			skip = n + v;
			break;
		default: return -1;
		}
		if (skip > len)
			return -1;
		b += skip, len -= skip;
	}
	return has_type ? 0 : -1;
}

#ifndef LAZYFORK_PROXY_TEST

static const char *self_name;

static void die(const char *what)
{
	fprintf(stderr, "lazyfork criu proxy (%s): %s: %s\n", self_name, what, strerror(errno));
	exit(1);
}

static int write_all(int fd, const void *p, size_t n)
{
	while (n > 0) {
		ssize_t m = write(fd, p, n);
		if (m < 0 && errno == EINTR)
			continue;
		if (m <= 0)
			return -1;
		p = (const char *)p + m, n -= m;
	}
	return 0;
}

/* Executes the real program: env's path, or the first name on PATH that is
 * not this binary (what runc or CRIU would have run without the proxy). */
static void exec_real(const char *env, const char *name, char **argv)
{
	const char *real = getenv(env);
	struct stat me, st;
	if (real && *real) {
		if (stat(real, &st) == 0 && stat("/proc/self/exe", &me) == 0 &&
		    st.st_dev == me.st_dev && st.st_ino == me.st_ino) {
			fprintf(stderr, "lazyfork criu proxy: %s (%s) is this proxy, not the real %s; "
				"reinstall (make install) or turn the proxy off (LAZYFORK_CRIU_PROXY=off)\n", real, env, name);
			exit(127);
		}
		execv(real, argv);
		fprintf(stderr, "lazyfork criu proxy: exec %s (%s): %s\n", real, env, strerror(errno));
		exit(127);
	}
	const char *path = getenv("PATH");
	if (stat("/proc/self/exe", &me) == 0 && path) {
		char p[4096];
		for (const char *d = path; *d;) {
			size_t l = strcspn(d, ":");
			if (d[0] == '/' && l + strlen(name) + 2 <= sizeof p) {
				snprintf(p, sizeof p, "%.*s/%s", (int)l, d, name);
				if (stat(p, &st) == 0 && S_ISREG(st.st_mode) && (st.st_mode & 0111) &&
				    !(st.st_dev == me.st_dev && st.st_ino == me.st_ino)) {
					execv(p, argv);
					fprintf(stderr, "lazyfork criu proxy: exec %s: %s\n", p, strerror(errno));
					exit(127);
				}
			}
			d += l + (d[l] == ':');
		}
	}
	fprintf(stderr, "lazyfork criu proxy: no %s on PATH but this proxy; set %s or turn the proxy off "
		"(LAZYFORK_CRIU_PROXY=off in the shim's environment)\n", name, env);
	exit(127);
}

static int hexval(char c)
{
	return c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* The real CRIU's answer to a VERSION request, if the shim gave one for the
 * binary LAZYFORK_CRIU_REAL as it is now: its length, or 0. */
static size_t cached_answer(unsigned char *out, size_t max)
{
	const char *real = getenv("LAZYFORK_CRIU_REAL"), *id = getenv("LAZYFORK_CRIU_REAL_ID");
	const char *hex = getenv("LAZYFORK_CRIU_VERSION_ANSWER");
	struct stat st;
	char now[128];
	if (!real || !id || !hex || stat(real, &st) != 0)
		return 0;
	snprintf(now, sizeof now, "%llu:%llu:%lld:%lld", (unsigned long long)st.st_dev,
		 (unsigned long long)st.st_ino, (long long)st.st_size,
		 (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec);
	size_t n = strlen(hex) / 2;
	if (strcmp(now, id) != 0 || n == 0 || n > max || strlen(hex) != 2 * n)
		return 0;
	for (size_t i = 0; i < n; i++) {
		int hi = hexval(hex[2 * i]), lo = hexval(hex[2 * i + 1]);
		if (hi < 0 || lo < 0)
			return 0;
		out[i] = hi << 4 | lo;
	}
	return n;
}

static void criu_main(int argc, char **argv)
{
	static unsigned char answer[MAX_MSG];
	char *end;
	int type, dom;
	socklen_t sl = sizeof type;
	if (argc != 3 || strcmp(argv[1], "swrk") != 0 || argv[2][0] < '0' || argv[2][0] > '9' ||
	    (argv[2][0] == '0' && argv[2][1]))
		return;
	errno = 0;
	long fd = strtol(argv[2], &end, 10);
	if (*end || errno || fd > 1 << 20)
		return;
	if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &sl) || type != SOCK_SEQPACKET)
		return;
	sl = sizeof dom;
	if (getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &dom, &sl) || dom != AF_UNIX)
		return;
	ssize_t n;
	do /* the request's whole length (MSG_TRUNC), as it is (MSG_PEEK) */
		n = recv(fd, buf, sizeof buf, MSG_PEEK | MSG_TRUNC);
	while (n < 0 && errno == EINTR);
	uint64_t rt = 0;
	int keep;
	if (n <= 0 || n > (ssize_t)sizeof buf || parse_req(buf, n, &rt, &keep) || rt != REQ_VERSION || keep)
		return;
	size_t an = cached_answer(answer, sizeof answer);
	if (!an)
		return;
	/* From here on the request is ours. */
	ssize_t m;
	do
		m = recv(fd, buf, sizeof buf, MSG_TRUNC);
	while (m < 0 && errno == EINTR);
	if (m != n)
		die("read the version request");
	if (write_all(fd, answer, an))
		die("answer the version request");
	exit(0);
}

/* The arguments CRIU 4.1 runs tar with to dump a tmpfs mount
 * (criu/filesystems.c, tmpfs_dump), the mount's root on standard input. */
static const char *const criu_create[] = {"--create", "--gzip", "--no-unquote", "--no-wildcards",
	"--one-file-system", "--check-links", "--preserve-permissions", "--sparse",
	"--numeric-owner", "--directory", "/proc/self/fd/0", ".", NULL};

static uint32_t crc32(const unsigned char *p, size_t n)
{
	uint32_t c = 0xffffffff;
	while (n--) {
		c ^= *p++;
		for (int k = 0; k < 8; k++)
			c = (c >> 1) ^ (0xedb88320 & -(c & 1));
	}
	return ~c;
}

/* The archive of an empty directory, gzipped: header, a stored deflate
 * block of a "./" entry as GNU tar writes it and the two end-of-archive
 * blocks (GNU tar pads to a 10240-byte record; tar reads either), trailer.
 * 0 if fd 0 is no empty directory or an attribute does not fit. */
static int tar_answer(void)
{
	static unsigned char gz[10 + 5 + 3 * 512 + 8];
	unsigned char *t = gz + 15;
	struct stat st;
	char dents[1024] __attribute__((aligned(8)));
	long n;
	if (fstat(0, &st) || !S_ISDIR(st.st_mode) || lseek(0, 0, SEEK_SET) != 0)
		return 0;
	while ((n = getdents64(0, dents, sizeof dents)) > 0)
		for (long off = 0; off < n; off += ((struct dirent64 *)(dents + off))->d_reclen) {
			const char *d = ((struct dirent64 *)(dents + off))->d_name;
			if (strcmp(d, ".") && strcmp(d, "..")) {
				lseek(0, 0, SEEK_SET); /* for the real tar, as it was */
				return 0;
			}
		}
	if (n < 0 || lseek(0, 0, SEEK_SET) != 0 || fstat(0, &st))
		return 0;
	if (st.st_uid > 07777777 || st.st_gid > 07777777 || st.st_mtim.tv_sec < 0 ||
	    st.st_mtim.tv_sec > 077777777777LL)
		return 0;
	/* The tar header (GNU format: magic "ustar  "), as GNU tar 1.34 writes it. */
	strcpy((char *)t, "./");
	sprintf((char *)t + 100, "%07o", (unsigned)(st.st_mode & 07777));
	sprintf((char *)t + 108, "%07o", (unsigned)st.st_uid);
	sprintf((char *)t + 116, "%07o", (unsigned)st.st_gid);
	sprintf((char *)t + 124, "%011o", 0);
	sprintf((char *)t + 136, "%011llo", (unsigned long long)st.st_mtim.tv_sec);
	memset(t + 148, ' ', 8);
	t[156] = '5';
	memcpy(t + 257, "ustar  ", 8);
	unsigned sum = 0;
	for (int i = 0; i < 512; i++)
		sum += t[i];
	sprintf((char *)t + 148, "%06o", sum); /* then NUL and the space left */
	/* gzip: magic, deflate, no flags, no time, no extra flags, OS Unix. */
	memcpy(gz, "\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03", 10);
	size_t len = 3 * 512;
	gz[10] = 1; /* the final block, stored */
	gz[11] = len & 0xff, gz[12] = len >> 8, gz[13] = ~len & 0xff, gz[14] = (~len >> 8) & 0xff;
	uint32_t crc = crc32(t, len);
	unsigned char *tr = t + len;
	for (int i = 0; i < 4; i++)
		tr[i] = crc >> (8 * i), tr[4 + i] = len >> (8 * i);
	if (write_all(1, gz, sizeof gz))
		die("write the archive");
	return 1;
}

static void tar_main(int argc, char **argv)
{
	int i;
	for (i = 0; criu_create[i]; i++)
		if (i + 1 >= argc || strcmp(argv[i + 1], criu_create[i]) != 0)
			return;
	if (argc == i + 1 && tar_answer())
		exit(0);
}

int main(int argc, char **argv)
{
	const char *b = strrchr(argv[0] ? argv[0] : "", '/');
	self_name = b ? b + 1 : argv[0] ? argv[0] : "";
	if (strcmp(self_name, "criu") == 0) {
		criu_main(argc, argv);
		exec_real("LAZYFORK_CRIU_REAL", "criu", argv);
	}
	if (strcmp(self_name, "tar") == 0) {
		tar_main(argc, argv);
		exec_real("LAZYFORK_TAR_REAL", "tar", argv);
	}
	fprintf(stderr, "lazyfork criu proxy: run as %s: install it as criu and tar\n", self_name);
	return 127;
}

#else /* LAZYFORK_PROXY_TEST: requests on stdin (a 4-byte little-endian length,
       * then the bytes), one line each on stdout: "type keep_open" or "error". */

int main(void)
{
	unsigned char l[4];
	while (fread(l, 1, 4, stdin) == 4) {
		size_t n = l[0] | l[1] << 8 | l[2] << 16 | (size_t)l[3] << 24;
		uint64_t type;
		int keep;
		if (n > sizeof buf || fread(buf, 1, n, stdin) != n)
			return 1;
		if (parse_req(buf, n, &type, &keep))
			printf("error\n");
		else
			printf("%llu %d\n", (unsigned long long)type, keep);
	}
	return 0;
}
#endif
