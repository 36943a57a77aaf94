// Command sockforward stands in for Lima's socket forwarding in tests: it
// forwards unix sockets across a mount and network namespace boundary that
// shares nothing but one inherited socket, as Lima forwards a guest's
// sockets to the host over its ssh (or gRPC) channel.
//
//	sockforward guest FD NAME=PATH...   (beside the stack: dials PATH)
//	sockforward host FD NAME=PATH...    (in the client's namespace: listens on PATH)
//
// FD is one end of a SOCK_SEQPACKET socketpair that the test creates and
// passes to both. For every connection accepted on the host side, host makes
// a socketpair and sends one end to guest with the socket's NAME (SCM_RIGHTS);
// guest dials NAME's PATH and copies both ways. The client's namespace never
// sees the stack's socket paths.
package main

import (
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

func main() {
	if len(os.Args) < 4 || (os.Args[1] != "guest" && os.Args[1] != "host") {
		fmt.Fprintln(os.Stderr, "usage: sockforward guest|host FD NAME=PATH...")
		os.Exit(2)
	}
	fd, err := strconv.Atoi(os.Args[2])
	if err != nil {
		fatal(err)
	}
	socks := map[string]string{}
	for _, a := range os.Args[3:] {
		name, path, ok := strings.Cut(a, "=")
		if !ok {
			fatal(fmt.Errorf("%q is not NAME=PATH", a))
		}
		socks[name] = path
	}
	if os.Args[1] == "guest" {
		fatal(guest(fd, socks))
	}
	fatal(host(fd, socks))
}

func fatal(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "sockforward:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// guest receives (NAME, fd) pairs and connects each fd to NAME's socket.
func guest(ctl int, socks map[string]string) error {
	buf, oob := make([]byte, 256), make([]byte, unix.CmsgSpace(4))
	for {
		n, oobn, _, _, err := unix.Recvmsg(ctl, buf, oob, 0)
		if err != nil {
			return err
		}
		if n == 0 {
			return nil // the host side went away
		}
		msgs, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err != nil || len(msgs) != 1 {
			return fmt.Errorf("no fd with %q: %v", buf[:n], err)
		}
		fds, err := unix.ParseUnixRights(&msgs[0])
		if err != nil || len(fds) != 1 {
			return fmt.Errorf("no fd with %q: %v", buf[:n], err)
		}
		f := os.NewFile(uintptr(fds[0]), "forwarded")
		path, ok := socks[string(buf[:n])]
		if !ok {
			f.Close()
			continue
		}
		go func() {
			defer f.Close()
			c, err := net.FileConn(f)
			if err != nil {
				return
			}
			defer c.Close()
			d, err := net.Dial("unix", path)
			if err != nil {
				fmt.Fprintln(os.Stderr, "sockforward: dial", path+":", err)
				return
			}
			splice(c.(*net.UnixConn), d.(*net.UnixConn))
		}()
	}
}

// host listens on every PATH and sends a socketpair end per connection.
func host(ctl int, socks map[string]string) error {
	var mu sync.Mutex
	errs := make(chan error, len(socks))
	for name, path := range socks {
		if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
			return err
		}
		os.Remove(path)
		l, err := net.Listen("unix", path)
		if err != nil {
			return err
		}
		go func() {
			for {
				c, err := l.Accept()
				if err != nil {
					errs <- err
					return
				}
				pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				err = unix.Sendmsg(ctl, []byte(name), unix.UnixRights(pair[1]), nil, 0)
				mu.Unlock()
				unix.Close(pair[1])
				if err != nil {
					errs <- fmt.Errorf("the guest side is gone: %w", err)
					return
				}
				f := os.NewFile(uintptr(pair[0]), name)
				fc, err := net.FileConn(f)
				f.Close()
				if err != nil {
					c.Close()
					continue
				}
				go splice(c.(*net.UnixConn), fc.(*net.UnixConn))
			}
		}()
	}
	return <-errs
}

// splice copies both ways, passing each side's end of writing on.
func splice(a, b *net.UnixConn) {
	var wg sync.WaitGroup
	wg.Add(2)
	cp := func(dst, src *net.UnixConn) {
		defer wg.Done()
		io.Copy(dst, src)
		dst.CloseWrite()
	}
	go cp(a, b)
	go cp(b, a)
	wg.Wait()
	a.Close()
	b.Close()
}
