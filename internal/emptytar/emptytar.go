package emptytar

import (
	"archive/tar"
	"compress/gzip"
	"errors"
	"io"
	"os"
	"slices"
	"syscall"
	"time"
)

// criuCreate is the argument list CRIU 4.1 runs tar with to dump a tmpfs
// mount, the mount's root directory on standard input.
var criuCreate = []string{"--create", "--gzip", "--no-unquote", "--no-wildcards",
	"--one-file-system", "--check-links", "--preserve-permissions", "--sparse",
	"--numeric-owner", "--directory", "/proc/self/fd/0", "."}

// IsCRIUCreate reports whether args (without the program name) are CRIU's
// tmpfs dump.
func IsCRIUCreate(args []string) bool { return slices.Equal(args, criuCreate) }

// Answer writes to w the gzipped archive of the empty directory dir that
// `tar` run with args would write, and reports true, when args are CRIU's
// tmpfs dump (IsCRIUCreate) and dir is a directory with no entries. It
// writes nothing and reports false otherwise: the caller runs tar. An
// error after true means the archive may be partly written: the caller
// fails, it must not run tar on top.
func Answer(args []string, dir *os.File, w io.Writer) (bool, error) {
	if !IsCRIUCreate(args) {
		return false, nil
	}
	fi, err := dir.Stat()
	if err != nil || !fi.IsDir() {
		return false, nil
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		return false, nil
	}
	names, err := dir.Readdirnames(1)
	if len(names) > 0 || !errors.Is(err, io.EOF) {
		return false, nil
	}
	// Read its attributes after the listing, as tar does: the listing
	// updates nothing tar records (its access time is not archived).
	zw, err := gzip.NewWriterLevel(w, gzip.DefaultCompression)
	if err != nil {
		return false, err
	}
	zw.OS = 3 // Unix, as gzip(1) writes
	tw := tar.NewWriter(zw)
	hdr := &tar.Header{
		Typeflag: tar.TypeDir,
		Name:     "./",
		Mode:     int64(st.Mode & 0o7777),
		Uid:      int(st.Uid),
		Gid:      int(st.Gid),
		ModTime:  time.Unix(st.Mtim.Sec, 0),
		Format:   tar.FormatGNU,
	}
	if err := tw.WriteHeader(hdr); err != nil {
		return true, err
	}
	if err := tw.Close(); err != nil {
		return true, err
	}
	return true, zw.Close()
}
