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
 * does. runc's version check goes through go-criu, which hands CRIU its
 * socketpair's own descriptor (never 3 while stdio is open); runc's dumps,
 * restores and feature checks pass theirs as the first extra file, fd 3.
 * `swrk 3` therefore starts the real CRIU at once, unpeeked: a restore's
 * request comes only after runc has put CRIU into the task's cgroups, and
 * CRIU loads meanwhile. Any other request that has not come within
 * VERSION_WAIT_MS is left to the real CRIU too. The proxy
 * answers only if the real CRIU (LAZYFORK_CRIU_REAL) still has the identity
 * the answer came from (LAZYFORK_CRIU_REAL_ID, device:inode:size:mtime-in-ns):
 * an upgraded CRIU is asked again.
 *
 * tar: CRIU dumps every tmpfs mount with `tar --create --gzip ...`, the
 * mount's root on standard input, and restores it with `tar --extract --gzip
 * ... --directory DIR`, the archive (its image file) on standard input. For
 * exactly CRIU's create arguments and a tree of directories, symlinks, device
 * nodes, fifos and small regular files on one file system (no hard links,
 * sparse files, sockets, names or links of 100 bytes or more, numbers beyond
 * octal: GNU tar writes those otherwise) the proxy writes the tar stream GNU
 * tar 1.34 writes, byte for byte (GNU format, numeric owner, the directory's
 * own order, depth first, padded to the 10240-byte record), gzipped in
 * stored deflate blocks. CRIU's flags ask for no xattrs, ACLs or SELinux
 * labels, so GNU tar archives none. For exactly CRIU's extract arguments it
 * reads the whole archive first and, if it is a gzip of stored blocks only
 * (CRC-32 and length right) of such entries, well formed (checksums, GNU
 * magic, no owner names, names "./..." without empty, "." or ".."
 * components, each once, depth first with every parent a directory entry
 * before it, so nothing leads out of DIR or through a symlink) and DIR is
 * empty (CRIU's new tmpfs), extracts it as GNU tar does as root: owner, then
 * mode (set-id bits kept), mtime; directories last, deepest first. Anything
 * else is the real tar's, with standard input as it came (a file seeked back,
 * a pipe's bytes in a memfd). A failure after the first entry is written
 * ends the proxy with a message and status 2 (CRIU fails the restore).
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
#include <fcntl.h>
#include <poll.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/socket.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#define REQ_VERSION 10 /* CRIU_REQ_TYPE__VERSION (images/rpc.proto) */
#define FIELD_TYPE 1   /* criu_req.type */
#define FIELD_KEEP 4   /* criu_req.keep_open */
#define MAX_MSG (64 << 10)
#define VERSION_WAIT_MS 5 /* how long a version request may take to come */

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

/* A dump the shim holds back (shim/dumpgate.go): the shim starts `runc
 * checkpoint` while it still moves the container onto its memory file, so
 * that runc's start-up runs beside the move instead of after it, and holds
 * CRIU's start at this gate: the file LAZYFORK_CRIU_GATE + the container's
 * id (runc's last argument; its command is `checkpoint`), locked by the shim.
 * The dump goes on once the shim has written "go" and unlocked; anything
 * else (the move failed, the shim went away, the file is no regular file)
 * ends it here, CRIU not run. No such file: no gate. */
static void wait_at_gate(void)
{
	const char *prefix = getenv("LAZYFORK_CRIU_GATE");
	static char cmdline[1 << 16];
	char path[4096], state[8];
	if (!prefix || prefix[0] != '/')
		return;
	snprintf(path, sizeof path, "/proc/%d/cmdline", (int)getppid());
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return;
	ssize_t n = 0, m;
	while (n < (ssize_t)sizeof cmdline && (m = read(fd, cmdline + n, sizeof cmdline - n)) > 0)
		n += m;
	close(fd);
	if (n <= 0 || n == (ssize_t)sizeof cmdline || cmdline[n - 1] != '\0')
		return; /* none, or longer than any runc checkpoint's */
	const char *id = NULL;
	int checkpoint = 0;
	for (const char *a = cmdline; a < cmdline + n; a += strlen(a) + 1) {
		if (id && strcmp(id, "checkpoint") == 0)
			checkpoint = 1;
		id = a;
	}
	if (!checkpoint || !id[0] || id[0] == '.' || strchr(id, '/') ||
	    snprintf(path, sizeof path, "%s%s", prefix, id) >= (int)sizeof path)
		return;
	fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
	if (fd < 0 && errno == ENOENT)
		return;
	struct stat st;
	int r = -1;
	n = -1;
	if (fd >= 0 && fstat(fd, &st) == 0 && S_ISREG(st.st_mode)) {
		do
			r = flock(fd, LOCK_SH);
		while (r < 0 && errno == EINTR);
		do
			n = pread(fd, state, sizeof state, 0);
		while (n < 0 && errno == EINTR);
	}
	if (fd >= 0)
		close(fd);
	if (r == 0 && n == 2 && memcmp(state, "go", 2) == 0)
		return;
	fprintf(stderr, "lazyfork criu proxy: the shim called off the dump of %s (its move onto the "
		"memory file failed, or the shim went away)\n", id);
	exit(1);
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
	if (fd == 3)
		return; /* runc's own request (above): the real CRIU, now */
	/* go-criu writes the VERSION request as soon as CRIU starts. One not
	 * there yet is left to the real CRIU, as without us. */
	struct pollfd pfd = {.fd = fd, .events = POLLIN};
	int ready;
	do
		ready = poll(&pfd, 1, VERSION_WAIT_MS);
	while (ready < 0 && errno == EINTR);
	if (ready <= 0)
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
/* ... and to restore one (tmpfs_restore): then the directory (the new
 * mount), the archive (the image file) on standard input. */
static const char *const criu_extract[] = {"--extract", "--gzip", "--no-unquote", "--no-wildcards",
	"--directory", NULL};

#define MAX_ARCHIVE (16 << 20) /* a larger tar stream: the real tar */
#define MAX_FILE (1 << 20)     /* a larger regular file: the real tar */
#define MAX_DEPTH 32
#define MAX_ENTRIES 4096
#define MAX_DIRS 256           /* extraction keeps each directory open */
#define RECORD 10240           /* GNU tar's record: 20 blocks */
#define STORED_MAX 65535       /* a stored deflate block's most */

static uint32_t crc_table[256];

static uint32_t crc32(const unsigned char *p, size_t n)
{
	if (!crc_table[1])
		for (uint32_t i = 0; i < 256; i++) {
			uint32_t c = i;
			for (int k = 0; k < 8; k++)
				c = (c >> 1) ^ (0xedb88320 & -(c & 1));
			crc_table[i] = c;
		}
	uint32_t c = 0xffffffff;
	while (n--)
		c = crc_table[(c ^ *p++) & 0xff] ^ (c >> 8);
	return ~c;
}

struct buf {
	unsigned char *p;
	size_t len, cap;
};

/* n more bytes, zeroed, at the end of b; NULL past MAX_ARCHIVE or without
 * memory. */
static unsigned char *grow(struct buf *b, size_t n)
{
	if (n > MAX_ARCHIVE || b->len > MAX_ARCHIVE - n)
		return NULL;
	if (b->len + n > b->cap) {
		size_t cap = b->cap ? b->cap : 16384;
		while (cap < b->len + n)
			cap *= 2;
		unsigned char *p = realloc(b->p, cap);
		if (!p)
			return NULL;
		b->p = p, b->cap = cap;
	}
	unsigned char *r = b->p + b->len;
	memset(r, 0, n);
	b->len += n;
	return r;
}

static int all_zero(const unsigned char *p, size_t n)
{
	while (n--)
		if (*p++)
			return 0;
	return 1;
}

/* ---- tar --create ---- */

/* One header as GNU tar 1.34 writes it with CRIU's flags: GNU format (magic
 * "ustar  "), the permission bits, numeric owner and no owner names, the
 * whole seconds of the modification time, device numbers for device nodes
 * only. -1 where GNU tar would write something else (a name or link of 100
 * bytes or more: a long-name entry; a number beyond octal: base 256): the
 * real tar writes those archives. */
static int put_header(struct buf *b, const char *name, const struct stat *st, char type,
		      const char *link, size_t size)
{
	unsigned long long maj = major(st->st_rdev), min = minor(st->st_rdev);
	int dev = type == '3' || type == '4';
	if (strlen(name) >= 100 || (link && strlen(link) >= 100) || st->st_uid > 07777777 ||
	    st->st_gid > 07777777 || st->st_mtim.tv_sec < 0 || st->st_mtim.tv_sec > 077777777777LL ||
	    (dev && (maj > 07777777 || min > 07777777)))
		return -1;
	unsigned char *t = grow(b, 512);
	if (!t)
		return -1;
	strcpy((char *)t, name);
	sprintf((char *)t + 100, "%07o", (unsigned)(st->st_mode & 07777));
	sprintf((char *)t + 108, "%07o", (unsigned)st->st_uid);
	sprintf((char *)t + 116, "%07o", (unsigned)st->st_gid);
	sprintf((char *)t + 124, "%011llo", (unsigned long long)size);
	sprintf((char *)t + 136, "%011llo", (unsigned long long)st->st_mtim.tv_sec);
	memset(t + 148, ' ', 8);
	t[156] = type;
	if (link)
		strcpy((char *)t + 157, link);
	memcpy(t + 257, "ustar  ", 8);
	if (dev) {
		sprintf((char *)t + 329, "%07llo", maj);
		sprintf((char *)t + 337, "%07llo", min);
	}
	unsigned sum = 0;
	for (int i = 0; i < 512; i++)
		sum += t[i];
	sprintf((char *)t + 148, "%06o", sum); /* then NUL and the space left */
	return 0;
}

struct walk {
	struct buf out;
	dev_t dev;
	int entries;
	char path[4096];
};

/* Archives the entries of directory dfd (its own header is written), whose
 * name in the archive is w->path[0:plen] ("./", "./pts/"), in the order GNU
 * tar does: the order the directory lists them in (tar's default --sort=none),
 * depth first. -1 for anything GNU tar would write otherwise or warn about
 * (another file system, a hard link, a socket, a sparse or large file, ...). */
static int dump_dir(struct walk *w, int dfd, size_t plen, int depth)
{
	struct buf names = {0};
	char d[4096] __attribute__((aligned(8)));
	long n;
	int ret = -1;
	if (lseek(dfd, 0, SEEK_SET) != 0)
		return -1;
	while ((n = getdents64(dfd, d, sizeof d)) > 0)
		for (long off = 0; off < n; off += ((struct dirent64 *)(d + off))->d_reclen) {
			const char *nm = ((struct dirent64 *)(d + off))->d_name;
			if (!strcmp(nm, ".") || !strcmp(nm, ".."))
				continue;
			size_t l = strlen(nm) + 1;
			unsigned char *q = grow(&names, l);
			if (!q)
				goto out;
			memcpy(q, nm, l);
		}
	if (n < 0)
		goto out;
	for (size_t i = 0; i < names.len; i += strlen((char *)names.p + i) + 1) {
		const char *name = (char *)names.p + i;
		size_t nl = strlen(name);
		struct stat st, st2;
		int fd, r;
		if (++w->entries > MAX_ENTRIES || plen + nl + 2 > sizeof w->path)
			goto out;
		memcpy(w->path + plen, name, nl + 1);
		if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) || st.st_dev != w->dev)
			goto out;
		switch (st.st_mode & S_IFMT) {
		case S_IFDIR:
			w->path[plen + nl] = '/', w->path[plen + nl + 1] = 0;
			if (depth >= MAX_DEPTH || put_header(&w->out, w->path, &st, '5', NULL, 0))
				goto out;
			fd = openat(dfd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
			if (fd < 0)
				goto out;
			r = fstat(fd, &st2) || st2.st_dev != st.st_dev || st2.st_ino != st.st_ino ||
			    dump_dir(w, fd, plen + nl + 1, depth + 1);
			close(fd);
			if (r)
				goto out;
			break;
		case S_IFLNK: {
			char l[100];
			ssize_t m = readlinkat(dfd, name, l, sizeof l);
			/* A hard-linked symlink is a link entry in GNU tar's. */
			if (st.st_nlink != 1 || m <= 0 || m >= (ssize_t)sizeof l || m != st.st_size)
				goto out;
			l[m] = 0;
			if (put_header(&w->out, w->path, &st, '2', l, 0))
				goto out;
			break;
		}
		case S_IFCHR:
		case S_IFBLK:
		case S_IFIFO:
			if (st.st_nlink != 1 || put_header(&w->out, w->path, &st,
							   S_ISCHR(st.st_mode) ? '3' : S_ISBLK(st.st_mode) ? '4' : '6',
							   NULL, 0))
				goto out;
			break;
		case S_IFREG: {
			/* GNU tar's test for a sparse file (ST_IS_SPARSE): fewer
			 * blocks than the size needs. */
			if (st.st_nlink != 1 || st.st_size < 0 || st.st_size > MAX_FILE ||
			    st.st_blocks < st.st_size / 512 + (st.st_size % 512 != 0))
				goto out;
			size_t size = st.st_size;
			if (put_header(&w->out, w->path, &st, '0', NULL, size))
				goto out;
			unsigned char *data = grow(&w->out, (size + 511) / 512 * 512), one;
			if (!data)
				goto out;
			fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NOCTTY | O_NONBLOCK | O_CLOEXEC);
			if (fd < 0)
				goto out;
			/* The file opened is the one looked at (not a device node
			 * swapped in meanwhile), checked before anything is read. */
			if (fstat(fd, &st2) || !S_ISREG(st2.st_mode) || st2.st_dev != st.st_dev || st2.st_ino != st.st_ino) {
				close(fd);
				goto out;
			}
			size_t got = 0;
			ssize_t m = 0;
			while (got < size && ((m = read(fd, data + got, size - got)) > 0 || (m < 0 && errno == EINTR)))
				if (m > 0)
					got += m;
			r = got != size || read(fd, &one, 1) != 0 || fstat(fd, &st2) || st2.st_ino != st.st_ino ||
			    st2.st_size != st.st_size || st2.st_mtim.tv_sec != st.st_mtim.tv_sec ||
			    st2.st_mtim.tv_nsec != st.st_mtim.tv_nsec || st2.st_ctim.tv_sec != st.st_ctim.tv_sec ||
			    st2.st_ctim.tv_nsec != st.st_ctim.tv_nsec; /* changed as we read it: GNU tar's test */
			close(fd);
			if (r)
				goto out;
			break;
		}
		default: /* a socket: GNU tar leaves it out with a warning */
			goto out;
		}
	}
	ret = 0;
out:
	free(names.p);
	return ret;
}

/* The gzip stream of p in stored deflate blocks, written to fd 1: header
 * (deflate, no flags, no time, OS Unix, as gzip writes a pipe's), blocks,
 * CRC-32 and length. */
static int write_gzip(const unsigned char *p, size_t len)
{
	size_t nb = len ? (len + STORED_MAX - 1) / STORED_MAX : 1;
	unsigned char *gz = malloc(10 + len + 5 * nb + 8), *q = gz;
	if (!gz)
		return -1;
	memcpy(q, "\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\x03", 10);
	q += 10;
	size_t off = 0;
	do {
		size_t n = len - off > STORED_MAX ? STORED_MAX : len - off;
		*q++ = off + n == len; /* BFINAL, BTYPE 00: stored */
		q[0] = n & 0xff, q[1] = n >> 8, q[2] = ~n & 0xff, q[3] = (~n >> 8) & 0xff;
		memcpy(q + 4, p + off, n);
		q += 4 + n, off += n;
	} while (off < len);
	uint32_t crc = crc32(p, len);
	for (int i = 0; i < 4; i++)
		q[i] = crc >> (8 * i), q[4 + i] = (uint32_t)len >> (8 * i);
	q += 8;
	int r = write_all(1, gz, q - gz);
	free(gz);
	return r;
}

/* CRIU's dump of the tmpfs on fd 0, if its tree holds only directories,
 * symlinks, device nodes, fifos and small regular files that GNU tar would
 * archive plainly: the archive GNU tar writes (the same tar stream, byte for
 * byte, padded to its 10240-byte record), gzipped in stored blocks. 0 (and
 * nothing written) for anything else. */
static int tar_create(void)
{
	struct walk *w = calloc(1, sizeof *w);
	struct stat st;
	int ok = 0;
	if (!w || fstat(0, &st) || !S_ISDIR(st.st_mode))
		goto out;
	w->dev = st.st_dev;
	strcpy(w->path, "./");
	ok = put_header(&w->out, "./", &st, '5', NULL, 0) == 0 && dump_dir(w, 0, 2, 0) == 0;
	lseek(0, 0, SEEK_SET); /* for the real tar, as it was */
	if (ok) { /* two zero blocks end the archive, then the record's rest */
		size_t len = (w->out.len + 1024 + RECORD - 1) / RECORD * RECORD;
		ok = grow(&w->out, len - w->out.len) != NULL;
	}
	if (ok && write_gzip(w->out.p, w->out.len))
		die("write the archive");
out:
	if (w)
		free(w->out.p);
	free(w);
	return ok;
}

/* ---- tar --extract ---- */

struct entry {
	char type;     /* '5' '2' '3' '4' '6' '0' */
	char name[100]; /* without "./" and a directory's "/": "" is the root */
	char link[100];
	int depth;     /* components in name */
	unsigned mode;
	unsigned long long uid, gid, size, maj, min;
	long long mtime;
	const unsigned char *data;
	int fd;        /* a directory's, while extracting */
};

/* A numeric field as GNU tar writes it: octal digits, then NULs or spaces
 * to its end. */
static int octal(const unsigned char *f, size_t w, unsigned long long *v)
{
	size_t i = 0;
	*v = 0;
	for (; i < w && f[i] >= '0' && f[i] <= '7'; i++) {
		if (*v >> 60)
			return -1;
		*v = *v * 8 + (f[i] - '0');
	}
	if (i == 0 || i == w)
		return -1;
	for (; i < w; i++)
		if (f[i] && f[i] != ' ')
			return -1;
	return 0;
}

/* The tar stream of a gzip of stored deflate blocks only, checked (its
 * CRC-32 and length, nothing after it), or NULL. */
static unsigned char *gunzip_stored(const unsigned char *gz, size_t n, size_t *len)
{
	struct buf out = {0};
	if (n < 18 || gz[0] != 0x1f || gz[1] != 0x8b || gz[2] != 8 || gz[3] != 0)
		return NULL;
	size_t i = 10;
	for (int final = 0; !final;) {
		if (n - i < 5 + 8 || (gz[i] & 6) != 0) /* BTYPE 00 only */
			goto bad;
		final = gz[i] & 1;
		size_t l = gz[i + 1] | gz[i + 2] << 8, nl = gz[i + 3] | gz[i + 4] << 8;
		i += 5;
		unsigned char *q;
		if ((l ^ nl) != 0xffff || l > n - i - 8 || !(q = grow(&out, l)))
			goto bad;
		memcpy(q, gz + i, l);
		i += l;
	}
	if (n - i != 8)
		goto bad;
	uint32_t crc = crc32(out.p ? out.p : (unsigned char *)"", out.len), c = 0, s = 0;
	for (int k = 0; k < 4; k++)
		c |= (uint32_t)gz[i + k] << (8 * k), s |= (uint32_t)gz[i + 4 + k] << (8 * k);
	if (c != crc || s != (uint32_t)out.len)
		goto bad;
	*len = out.len;
	return out.p;
bad:
	free(out.p);
	return NULL;
}

/* Reads the entries of a tar stream GNU tar's create with CRIU's flags
 * writes, as the proxy's tar_create does; the number of entries, or -1 for
 * anything else: another format or entry type, a bad checksum, owner names,
 * a name not "./..." or with an empty, "." or ".." component, an entry
 * twice, an entry whose parent is no directory entry before it, entries not
 * in depth-first order (so no directory is written again after its time is
 * set, and no entry can lead through a symlink), a truncated stream. */
static int parse_tar(const unsigned char *p, size_t len, struct entry *es)
{
	int n = 0, dirs = 0;
	size_t off = 0;
	if (len % 512)
		return -1;
	for (;;) {
		if (len - off < 512)
			return -1; /* no end-of-archive block */
		const unsigned char *h = p + off;
		if (all_zero(h, 512))
			return all_zero(h, len - off) ? n : -1;
		if (n >= MAX_ENTRIES)
			return -1;
		struct entry *e = &es[n];
		unsigned long long sum, mode, mtime;
		unsigned s = 0;
		for (int i = 0; i < 512; i++)
			s += i >= 148 && i < 156 ? ' ' : h[i];
		if (octal(h + 148, 8, &sum) || sum != s || memcmp(h + 257, "ustar  ", 8) ||
		    !memchr(h, 0, 100) || !memchr(h + 157, 0, 100) || !all_zero(h + 265, 64) ||
		    !all_zero(h + 345, 512 - 345) || octal(h + 100, 8, &mode) || mode > 07777 ||
		    octal(h + 108, 8, &e->uid) || octal(h + 116, 8, &e->gid) || octal(h + 124, 12, &e->size) ||
		    octal(h + 136, 12, &mtime) || mtime > 077777777777ULL)
			return -1;
		e->type = h[156], e->mode = mode, e->mtime = mtime, e->maj = e->min = 0, e->fd = -1;
		if (!strchr("523460", e->type) || !e->type)
			return -1;
		if (e->type == '3' || e->type == '4') {
			if (octal(h + 329, 8, &e->maj) || octal(h + 337, 8, &e->min))
				return -1;
		} else if (!all_zero(h + 329, 16))
			return -1;
		if ((e->type == '2') != (h[157] != 0))
			return -1; /* a link name, and only for a symlink */
		strcpy(e->link, (const char *)h + 157);
		off += 512;
		if (e->type == '0') {
			if (e->size > len - off)
				return -1;
			e->data = p + off;
			off += (e->size + 511) / 512 * 512;
			if (off > len)
				return -1;
		} else if (e->size)
			return -1;
		/* The name. */
		const char *nm = (const char *)h;
		size_t l;
		if (strncmp(nm, "./", 2))
			return -1;
		nm += 2, l = strlen(nm);
		if (l == 0) {
			if (e->type != '5' || n != 0)
				return -1; /* the root: a directory, first */
		} else if (e->type == '5') {
			if (nm[l - 1] != '/' || l < 2)
				return -1;
			l--;
		} else if (nm[l - 1] == '/')
			return -1;
		memcpy(e->name, nm, l);
		e->name[l] = 0;
		e->depth = l ? 1 : 0;
		for (const char *c = e->name; l;) {
			size_t cl = strcspn(c, "/");
			if (cl == 0 || (cl == 1 && c[0] == '.') || (cl == 2 && c[0] == '.' && c[1] == '.'))
				return -1;
			if (!c[cl])
				break;
			c += cl + 1, e->depth++;
		}
		if (e->depth > MAX_DEPTH || (e->type == '5' && ++dirs > MAX_DIRS))
			return -1;
		for (int j = 0; j < n; j++)
			if (!strcmp(es[j].name, e->name))
				return -1;
		/* Its parent: the root, or the previous entry (a directory) or one
		 * of its ancestors (which are directory entries before it). */
		const char *slash = strrchr(e->name, '/');
		size_t pl = slash ? (size_t)(slash - e->name) : 0;
		if (pl) {
			const struct entry *prev = n ? &es[n - 1] : NULL;
			size_t ql = prev ? strlen(prev->name) : 0;
			if (!prev || ql < pl || memcmp(prev->name, e->name, pl) ||
			    (ql == pl ? prev->type != '5' : prev->name[pl] != '/'))
				return -1;
		}
		n++;
	}
}

static const char *extract_dir;

static void extract_fail(const struct entry *e, const char *what)
{
	fprintf(stderr, "lazyfork criu proxy (tar): extract ./%s into %s: %s: %s; the restore of this tmpfs "
		"failed part way (turn the proxy off with LAZYFORK_CRIU_PROXY=off if this repeats)\n",
		e->name, extract_dir, what, strerror(errno));
	exit(2);
}

/* Extracts the entries into the directory root as GNU tar does as root with
 * CRIU's flags (same owner, same permissions): each entry with its owner,
 * then its mode (so set-id bits stay), then its modification time (access
 * time left); directories' owner, mode and time last, deepest first. No
 * existing entry is met (root is empty, names are unique) and no symlink is
 * followed. The first creation failing leaves nothing written: 0, for the
 * real tar; later failures end the proxy. */
static int extract(int root, struct entry *es, int n)
{
	int stack[MAX_DEPTH + 1], written = 0;
	stack[0] = root;
	for (int i = 0; i < n; i++) {
		struct entry *e = &es[i];
		struct timespec ts[2] = {{0, UTIME_OMIT}, {e->mtime, 0}};
		if (e->depth == 0) {
			e->fd = root;
			continue;
		}
		int pfd = stack[e->depth - 1], r;
		const char *base = strrchr(e->name, '/');
		base = base ? base + 1 : e->name;
		switch (e->type) {
		case '5':
			r = mkdirat(pfd, base, 0700);
			break;
		case '2':
			r = symlinkat(e->link, pfd, base);
			break;
		case '0':
			r = e->fd = openat(pfd, base, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
			break;
		default:
			r = mknodat(pfd, base, (e->type == '3' ? S_IFCHR : e->type == '4' ? S_IFBLK : S_IFIFO) | 0600,
				    makedev(e->maj, e->min));
		}
		if (r < 0) {
			if (!written)
				return 0;
			extract_fail(e, "create");
		}
		written = 1;
		switch (e->type) {
		case '5':
			if ((e->fd = openat(pfd, base, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)) < 0)
				extract_fail(e, "open the new directory");
			stack[e->depth] = e->fd;
			break;
		case '0':
			if (write_all(e->fd, e->data, e->size) || fchown(e->fd, e->uid, e->gid) ||
			    fchmod(e->fd, e->mode) || futimens(e->fd, ts) || close(e->fd))
				extract_fail(e, "write");
			e->fd = -1;
			break;
		case '2':
			if (fchownat(pfd, base, e->uid, e->gid, AT_SYMLINK_NOFOLLOW) ||
			    utimensat(pfd, base, ts, AT_SYMLINK_NOFOLLOW))
				extract_fail(e, "set the owner and time");
			break;
		default:
			if (fchownat(pfd, base, e->uid, e->gid, AT_SYMLINK_NOFOLLOW) || fchmodat(pfd, base, e->mode, 0) ||
			    utimensat(pfd, base, ts, AT_SYMLINK_NOFOLLOW))
				extract_fail(e, "set the owner, mode and time");
		}
	}
	for (int i = n - 1; i >= 0; i--) {
		struct entry *e = &es[i];
		struct timespec ts[2] = {{0, UTIME_OMIT}, {e->mtime, 0}};
		if (e->type != '5')
			continue;
		if (fchown(e->fd, e->uid, e->gid) || fchmod(e->fd, e->mode) || futimens(e->fd, ts))
			extract_fail(e, "set the directory's owner, mode and time");
		if (e->fd != root)
			close(e->fd);
	}
	return 1;
}

/* Gives the real tar standard input as it came: seeks a regular file back,
 * or else puts what was read and the rest into a memfd. */
static void unread_stdin(const struct buf *in, off_t start)
{
	if (start >= 0 && lseek(0, start, SEEK_SET) == start)
		return;
	int fd = memfd_create("lazyfork-tar-stdin", 0);
	if (fd < 0 || write_all(fd, in->p, in->len))
		die("keep standard input for the real tar");
	static char b[65536];
	ssize_t m;
	while ((m = read(0, b, sizeof b)) > 0 || (m < 0 && errno == EINTR))
		if (m > 0 && write_all(fd, b, m))
			die("keep standard input for the real tar");
	if (m < 0 || lseek(fd, 0, SEEK_SET) != 0 || dup2(fd, 0) < 0)
		die("keep standard input for the real tar");
	close(fd);
}

/* CRIU's restore of a tmpfs's contents into dir: a gzip of stored blocks
 * (what tar_create writes) whose entries parse_tar accepts is extracted
 * here, into an empty dir; exits 0 then. Anything else returns with
 * standard input as it was, for the real tar. */
static void tar_extract(const char *dir)
{
	struct buf in = {0};
	struct stat st;
	unsigned char *tar = NULL;
	struct entry *es = NULL;
	size_t len;
	int n, root = -1, empty = 1;
	if (fstat(0, &st) || !(S_ISREG(st.st_mode) || S_ISFIFO(st.st_mode)))
		return; /* CRIU's is an image file; untouched for anything odd */
	off_t start = S_ISREG(st.st_mode) ? lseek(0, 0, SEEK_CUR) : -1;
	for (;;) {
		unsigned char *q = grow(&in, 65536);
		if (!q)
			goto real; /* too large: read no further */
		ssize_t m;
		do
			m = read(0, q, 65536);
		while (m < 0 && errno == EINTR);
		in.len -= 65536 - (m > 0 ? m : 0);
		if (m < 0)
			goto real;
		if (m == 0)
			break;
	}
	if (!(tar = gunzip_stored(in.p, in.len, &len)) || !(es = calloc(MAX_ENTRIES, sizeof *es)) ||
	    (n = parse_tar(tar, len, es)) < 0)
		goto real;
	extract_dir = dir;
	if ((root = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC)) < 0)
		goto real;
	char d[1024] __attribute__((aligned(8)));
	long dn;
	while (empty && (dn = getdents64(root, d, sizeof d)) > 0)
		for (long off = 0; off < dn; off += ((struct dirent64 *)(d + off))->d_reclen) {
			const char *nm = ((struct dirent64 *)(d + off))->d_name;
			if (strcmp(nm, ".") && strcmp(nm, ".."))
				empty = 0;
		}
	if (empty && dn == 0 && extract(root, es, n))
		exit(0);
real:
	if (root >= 0)
		close(root);
	free(es);
	free(tar);
	unread_stdin(&in, start);
	free(in.p);
}

static void tar_main(int argc, char **argv)
{
	int i;
	for (i = 0; criu_create[i]; i++)
		if (i + 1 >= argc || strcmp(argv[i + 1], criu_create[i]) != 0)
			break;
	if (!criu_create[i] && argc == i + 1 && tar_create())
		exit(0);
	for (i = 0; criu_extract[i]; i++)
		if (i + 1 >= argc || strcmp(argv[i + 1], criu_extract[i]) != 0)
			return;
	if (argc == i + 2)
		tar_extract(argv[i + 1]);
}

int main(int argc, char **argv)
{
	const char *b = strrchr(argv[0] ? argv[0] : "", '/');
	self_name = b ? b + 1 : argv[0] ? argv[0] : "";
	if (strcmp(self_name, "criu") == 0) {
		criu_main(argc, argv);
		wait_at_gate(); /* whatever the socket: CRIU never starts past a closed gate */
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
