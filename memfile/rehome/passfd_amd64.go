package rehome

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"github.com/containerd/errdefs"
	"golang.org/x/sys/unix"
)

// Scratch layout for receiveFile, written over the start of a writable VMA
// of the process (and put back): the socket pair, a msghdr, its iovec, the
// control buffer and the one data byte.
const (
	scratchPair    = 0
	scratchMsghdr  = 16
	scratchIovec   = 80
	scratchControl = 96
	scratchData    = 128
	scratchSize    = 136
)

// receiveFile gives process p a descriptor of f, which the caller holds
// open, as the sending side of SCM_RIGHTS: p makes a socket pair (injected),
// the tracer takes one end with pidfd_getfd and sends f through it, and p
// receives it with recvmsg. It is how a process whose memory view is
// read-only writes a memory file itself: one copy of each page, made by the
// process and charged to its own memory cgroup, instead of the tracer's two
// (read, then write). The descriptor is close-on-exec; the caller closes it.
// An error wrapping ErrNotImplemented means the process cannot take it
// (e.g. its seccomp profile denies the calls): copy by the tracer instead.
func (p *proc) receiveFile(f *os.File, vmas []VMA) (int64, error) {
	holder := -1
	for i, v := range vmas {
		if v.Prot&(unix.PROT_READ|unix.PROT_WRITE) == unix.PROT_READ|unix.PROT_WRITE && v.Len() >= scratchSize {
			holder = i
			break
		}
	}
	if holder < 0 {
		return -1, fmt.Errorf("rehome: process %d: no writable VMA for the descriptor passing: %w", p.pid, errdefs.ErrNotImplemented)
	}
	at := vmas[holder].Start
	orig := make([]byte, scratchSize)
	if _, err := p.mem.ReadAt(orig, int64(at)); err != nil {
		return -1, fmt.Errorf("rehome: process %d: read %#x: %w", p.pid, at, err)
	}
	putBack := func() error {
		if _, err := p.mem.WriteAt(orig, int64(at)); err != nil {
			return fmt.Errorf("rehome: process %d: put back the %d bytes at %#x the descriptor passing used: %w", p.pid, scratchSize, at, errors.Join(err, errdefs.ErrDataLoss))
		}
		return nil
	}
	fd, err := p.receive(f, at)
	if perr := putBack(); perr != nil {
		if fd >= 0 {
			p.syscall(unix.SYS_CLOSE, uint64(fd))
		}
		return -1, errors.Join(err, perr)
	}
	return fd, err
}

func (p *proc) receive(f *os.File, at uint64) (int64, error) {
	notImpl := func(what string, e error) error {
		return fmt.Errorf("rehome: process %d: pass the memory file: %s: %w", p.pid, what, errors.Join(e, errdefs.ErrNotImplemented))
	}
	// The scratch: msghdr{iov: 1 byte, control: one descriptor}.
	s := make([]byte, scratchSize)
	le := binary.LittleEndian
	le.PutUint64(s[scratchMsghdr+16:], at+scratchIovec)   // msg_iov
	le.PutUint64(s[scratchMsghdr+24:], 1)                 // msg_iovlen
	le.PutUint64(s[scratchMsghdr+32:], at+scratchControl) // msg_control
	le.PutUint64(s[scratchMsghdr+40:], uint64(unix.CmsgSpace(4)))
	le.PutUint64(s[scratchIovec:], at+scratchData)
	le.PutUint64(s[scratchIovec+8:], 1)
	if _, err := p.mem.WriteAt(s, int64(at)); err != nil {
		return -1, fmt.Errorf("rehome: process %d: write at %#x: %w", p.pid, at, err)
	}
	r, err := p.syscall(unix.SYS_SOCKETPAIR, unix.AF_UNIX, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0, at+scratchPair)
	if err != nil {
		return -1, err
	}
	if e := errno(r); e != nil {
		return -1, notImpl("socketpair", e)
	}
	var pair [8]byte
	if _, err := p.mem.ReadAt(pair[:], int64(at+scratchPair)); err != nil {
		return -1, fmt.Errorf("rehome: process %d: read the socket pair: %w", p.pid, err)
	}
	recvEnd, sendEnd := int64(int32(le.Uint32(pair[0:]))), int64(int32(le.Uint32(pair[4:])))
	closeBoth := func() error {
		return errors.Join(p.close(recvEnd), p.close(sendEnd))
	}
	if err := p.send(f, int(sendEnd)); err != nil {
		return -1, errors.Join(err, closeBoth())
	}
	r, err = p.syscall(unix.SYS_RECVMSG, uint64(recvEnd), at+scratchMsghdr, unix.MSG_CMSG_CLOEXEC|unix.MSG_DONTWAIT)
	if err != nil {
		return -1, err
	}
	if e := errno(r); e != nil || r != 1 {
		return -1, errors.Join(notImpl("recvmsg", cmpErr(e, r)), closeBoth())
	}
	ctl := make([]byte, unix.CmsgSpace(4))
	if _, err := p.mem.ReadAt(ctl, int64(at+scratchControl)); err != nil {
		return -1, errors.Join(fmt.Errorf("rehome: process %d: read the received descriptor: %w", p.pid, err), closeBoth())
	}
	fd := int64(-1)
	if msgs, err := unix.ParseSocketControlMessage(ctl); err == nil && len(msgs) == 1 {
		if fds, err := unix.ParseUnixRights(&msgs[0]); err == nil && len(fds) == 1 {
			fd = int64(fds[0])
		}
	}
	if fd < 0 {
		return -1, errors.Join(notImpl("no descriptor received", nil), closeBoth())
	}
	if err := closeBoth(); err != nil {
		p.close(fd)
		return -1, err
	}
	return fd, nil
}

// send takes the process's descriptor sendEnd (a socket) with pidfd_getfd
// and sends f through it.
func (p *proc) send(f *os.File, sendEnd int) error {
	pidfd, err := unix.PidfdOpen(p.pid, 0)
	if err != nil {
		return fmt.Errorf("rehome: process %d: pidfd_open: %w", p.pid, errors.Join(err, errdefs.ErrNotImplemented))
	}
	defer unix.Close(pidfd)
	sock, err := unix.PidfdGetfd(pidfd, sendEnd, 0)
	if err != nil {
		return fmt.Errorf("rehome: process %d: pidfd_getfd: %w", p.pid, errors.Join(err, errdefs.ErrNotImplemented))
	}
	defer unix.Close(sock)
	if err := unix.Sendmsg(sock, []byte{0}, unix.UnixRights(int(f.Fd())), nil, unix.MSG_DONTWAIT); err != nil {
		return fmt.Errorf("rehome: process %d: send the memory file: %w", p.pid, errors.Join(err, errdefs.ErrNotImplemented))
	}
	return nil
}
