package client

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"regexp"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/containerd/containerd/v2/core/transfer"
	"github.com/containerd/containerd/v2/pkg/progress"
	"golang.org/x/sys/unix"
)

// pullProgress shows a pull's transfer events: on a terminal one line per
// blob redrawn in place (kind, digest, state, bar, bytes) and a status
// line; elsewhere a line when the pull starts and one when it ends.
type pullProgress struct {
	mu       sync.Mutex
	out      io.Writer
	terminal bool
	width    int // of the terminal, for lines that wrap
	lines    int // on screen from the last draw
	ref      string
	start    time.Time
	status   string
	order    []string
	blobs    map[string]transfer.Progress
	finished bool
}

func newPullProgress(out io.Writer, terminal bool, ref, via string) *pullProgress {
	p := &pullProgress{out: out, terminal: terminal, width: 80, ref: ref, start: time.Now(), status: "resolving", blobs: map[string]transfer.Progress{}}
	if f, ok := out.(*os.File); ok {
		if ws, err := unix.IoctlGetWinsize(int(f.Fd()), unix.TIOCGWINSZ); err == nil && ws.Col > 0 {
			p.width = int(ws.Col)
		}
	}
	fmt.Fprintf(out, "%s: pulling from %s\n", ref, via)
	return p
}

func (p *pullProgress) update(ev transfer.Progress) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.finished {
		return
	}
	if !strings.Contains(ev.Name, "-sha256:") { // the pull's own events
		if ev.Event != "" {
			p.status = ev.Event
		}
	} else {
		if _, seen := p.blobs[ev.Name]; !seen {
			p.order = append(p.order, ev.Name)
		}
		p.blobs[ev.Name] = ev
	}
	p.draw()
}

// totals are the bytes done and known of every blob.
func (p *pullProgress) totals() (done, total int64) {
	for _, b := range p.blobs {
		done += b.Progress
		total += b.Total
	}
	return done, total
}

var ansiColor = regexp.MustCompile("\x1b\\[[0-9;]*m")

// draw replaces the last frame on the terminal with the current one.
func (p *pullProgress) draw() {
	if !p.terminal {
		return
	}
	var frame bytes.Buffer
	tw := tabwriter.NewWriter(&frame, 1, 8, 1, ' ', 0)
	for _, name := range p.order {
		b := p.blobs[name]
		kind, dgst, _ := strings.Cut(name, "-sha256:")
		if len(dgst) > 12 {
			dgst = dgst[:12]
		}
		frac := 0.0
		switch {
		case b.Event == "complete" || b.Event == "already exists" || b.Event == "extracted":
			frac = 1
		case b.Total > 0:
			frac = float64(b.Progress) / float64(b.Total)
		}
		fmt.Fprintf(tw, "%s %s:\t%s\t%30r\t%8.8s/%s\n", kind, dgst, b.Event, progress.Bar(frac),
			progress.Bytes(b.Progress), progress.Bytes(b.Total))
	}
	_ = tw.Flush()
	done, _ := p.totals()
	elapsed := time.Since(p.start)
	fmt.Fprintf(&frame, "%s   elapsed: %.1fs   total: %s (%v)\n", p.status, elapsed.Seconds(),
		progress.Bytes(done), progress.NewBytesPerSecond(done, elapsed))
	clear := strings.Repeat("\x1b[1A\x1b[2K", p.lines)
	_, _ = io.WriteString(p.out, clear+"\r"+frame.String())
	p.lines = 0
	for _, l := range strings.Split(strings.TrimSuffix(frame.String(), "\n"), "\n") {
		p.lines += (len(ansiColor.ReplaceAllString(l, ""))-1)/p.width + 1
	}
}

// finish draws the last state and the outcome.
func (p *pullProgress) finish(err error, took time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err == nil {
		p.status = "done"
		// Every blob of a pull that succeeded is fetched, whether or not
		// its last progress event arrived before the pull returned.
		for name, b := range p.blobs {
			if b.Total > 0 {
				b.Progress = b.Total
			}
			if b.Event != "already exists" && b.Event != "extracted" {
				b.Event = "complete"
			}
			p.blobs[name] = b
		}
	} else {
		p.status = "failed"
	}
	p.draw()
	p.finished = true
	if err != nil {
		fmt.Fprintf(p.out, "%s: pull failed after %.1fs\n", p.ref, took.Seconds())
		return
	}
	_, total := p.totals()
	fmt.Fprintf(p.out, "%s: pulled %d blobs, %s in %.1fs\n", p.ref, len(p.blobs), progress.Bytes(total), took.Seconds())
}
