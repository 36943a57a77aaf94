package memfile

import (
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/lazyfork/lazyfork/internal/fileextent"
)

// copier copies byte ranges between files with the cheapest call the kernel
// allows for the pair: copy_file_range (same filesystem: in-kernel, or a
// reflink), else sendfile (one copy through the page cache, works from ext4
// to tmpfs where copy_file_range says EXDEV), else pread/pwrite through a
// large buffer.
type copier struct {
	noCFR      map[[2]*os.File]bool
	noSendfile map[[2]*os.File]bool
	buf        []byte
	written    int64
}

func newCopier() *copier {
	return &copier{noCFR: map[[2]*os.File]bool{}, noSendfile: map[[2]*os.File]bool{}}
}

const copyChunk = 1 << 30

// copy copies n bytes from src at soff to dst at doff.
func (c *copier) copy(dst *os.File, doff int64, src *os.File, soff int64, n int64) error {
	key := [2]*os.File{dst, src}
	for n > 0 {
		if !c.noCFR[key] {
			so, do := soff, doff
			m, err := unix.CopyFileRange(int(src.Fd()), &so, int(dst.Fd()), &do, int(min(n, copyChunk)), 0)
			if err == nil && m > 0 {
				soff, doff, n = soff+int64(m), doff+int64(m), n-int64(m)
				c.written += int64(m)
				continue
			}
			if err == nil || fallbackErr(err) {
				c.noCFR[key] = true
				continue
			}
			return fmt.Errorf("copy_file_range: %w", err)
		}
		if !c.noSendfile[key] {
			m, err := c.sendfile(dst, doff, src, soff, n)
			soff, doff, n = soff+m, doff+m, n-m
			c.written += m
			if err == nil {
				continue
			}
			if m == 0 && fallbackErr(err) {
				c.noSendfile[key] = true
				continue
			}
			return err
		}
		m, err := c.readWrite(dst, doff, src, soff, n)
		c.written += m
		return err
	}
	return nil
}

// sendfile writes at dst's file position, so position it first.
func (c *copier) sendfile(dst *os.File, doff int64, src *os.File, soff int64, n int64) (int64, error) {
	if _, err := dst.Seek(doff, io.SeekStart); err != nil {
		return 0, err
	}
	var done int64
	for done < n {
		so := soff + done
		m, err := unix.Sendfile(int(dst.Fd()), int(src.Fd()), &so, int(min(n-done, copyChunk)))
		if err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			return done, err
		}
		if m == 0 {
			return done, fmt.Errorf("sendfile: short source at %d: %w", soff+done, io.ErrUnexpectedEOF)
		}
		done += int64(m)
	}
	return done, nil
}

// bufSize: 1 MiB stays in cache; 8 MiB measured slower here.
const bufSize = 1 << 20

func (c *copier) readWrite(dst *os.File, doff int64, src *os.File, soff int64, n int64) (int64, error) {
	if c.buf == nil {
		c.buf = make([]byte, bufSize)
	}
	var done int64
	for done < n {
		b := c.buf[:min(n-done, int64(len(c.buf)))]
		if _, err := src.ReadAt(b, soff+done); err != nil {
			return done, fmt.Errorf("read %s at %d: %w", src.Name(), soff+done, err)
		}
		if _, err := dst.WriteAt(b, doff+done); err != nil {
			return done, fmt.Errorf("write %s at %d: %w", dst.Name(), doff+done, err)
		}
		done += int64(len(b))
	}
	return done, nil
}

// fallbackErr reports errors that mean "not for this pair of files".
func fallbackErr(err error) bool {
	return errors.Is(err, unix.EXDEV) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) ||
		errors.Is(err, unix.EOPNOTSUPP) || errors.Is(err, unix.EBADF)
}

// copyData copies the data extents of src's [soff, soff+n) to dst at doff,
// skipping holes (SEEK_DATA/SEEK_HOLE), so a sparse region stays sparse.
func (c *copier) copyData(dst *os.File, doff int64, src *os.File, soff, n int64) error {
	end := soff + n
	pos := soff
	for pos < end {
		data, err := unix.Seek(int(src.Fd()), pos, unix.SEEK_DATA)
		if err != nil {
			if errors.Is(err, unix.ENXIO) {
				return nil // only holes up to EOF
			}
			return fmt.Errorf("seek data in %s: %w", src.Name(), err)
		}
		if data >= end {
			return nil
		}
		hole, err := unix.Seek(int(src.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("seek hole in %s: %w", src.Name(), err)
		}
		hole = min(hole, end)
		if err := c.copy(dst, doff+(data-soff), src, data, hole-data); err != nil {
			return err
		}
		pos = hole
	}
	return nil
}

// extentCache holds the data extents of the files a rewrite reads, by
// descriptor.
type extentCache map[uintptr][]fileextent.Extent

// dataPages counts the pages of f's [off, off+n) that hold data.
func (c extentCache) dataPages(f *os.File, off, n int64) (uint64, error) {
	ext, ok := c[f.Fd()]
	if !ok {
		var err error
		if ext, err = fileextent.Data(f); err != nil {
			return 0, err
		}
		c[f.Fd()] = ext
	}
	end := off + n
	var total int64
	for i := fileextent.From(ext, off); i < len(ext) && ext[i].Start < end; i++ {
		total += min(ext[i].End, end) - max(ext[i].Start, off)
	}
	return uint64((total + pageSize - 1) / pageSize), nil
}

// copyJob is a range of pages to copy into the memory file.
type copyJob struct {
	doff int64
	src  *os.File
	soff int64
	n    int64
}

// copyChunkPar is the unit of work of the parallel copy.
const copyChunkPar = 16 << 20

// flush copies the pending jobs into the memory file, on up to one worker per
// CPU (at most 4): one core does not saturate memory bandwidth when copying
// from the page cache into tmpfs. Each worker has its own descriptor of the
// memory file, since sendfile writes at the file position.
func (l *layout) flush() error {
	jobs := l.jobs
	l.jobs = nil
	var chunks []copyJob
	var total int64
	for _, j := range jobs {
		total += j.n
		for off := int64(0); off < j.n; off += copyChunkPar {
			n := min(copyChunkPar, j.n-off)
			chunks = append(chunks, copyJob{doff: j.doff + off, src: j.src, soff: j.soff + off, n: n})
		}
	}
	workers := min(runtime.NumCPU(), 4, len(chunks))
	if workers <= 1 || total < 2*copyChunkPar {
		for _, c := range chunks {
			if err := l.cp.copy(l.mem, c.doff, c.src, c.soff, c.n); err != nil {
				return err
			}
		}
		return nil
	}
	next := make(chan copyJob)
	errs := make([]error, workers)
	written := make([]int64, workers)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			dst, err := os.OpenFile(l.mf.file.path, os.O_WRONLY, 0)
			if err != nil {
				errs[w] = err
				for range next {
				}
				return
			}
			defer dst.Close()
			cp := newCopier()
			for c := range next {
				if errs[w] == nil {
					errs[w] = cp.copy(dst, c.doff, c.src, c.soff, c.n)
				}
			}
			written[w] = cp.written
		}(w)
	}
	for _, c := range chunks {
		next <- c
	}
	close(next)
	wg.Wait()
	for w := range written {
		l.mf.written += written[w]
	}
	return errors.Join(errs...)
}
