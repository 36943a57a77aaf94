package client

import (
	"fmt"
	"io"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/containerd/containerd/v2/core/transfer"
	"github.com/containerd/containerd/v2/pkg/progress"
)

// pullProgress shows a pull's transfer events: on a terminal one line per
// blob redrawn in place (kind, digest, state, bar, bytes) and a status
// line; elsewhere a line when the pull starts and one when it ends.
type pullProgress struct {
	mu       sync.Mutex
	out      io.Writer
	tw       *progress.Writer // terminal only
	ref      string
	start    time.Time
	status   string
	order    []string
	blobs    map[string]transfer.Progress
	finished bool
}

func newPullProgress(out io.Writer, terminal bool, ref, via string) *pullProgress {
	p := &pullProgress{out: out, ref: ref, start: time.Now(), status: "resolving", blobs: map[string]transfer.Progress{}}
	if terminal {
		p.tw = progress.NewWriter(out)
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

func (p *pullProgress) draw() {
	if p.tw == nil {
		return
	}
	tw := tabwriter.NewWriter(p.tw, 1, 8, 1, ' ', 0)
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
		fmt.Fprintf(tw, "%s %s:\t%s\t%30r\t%8.8s/%s\t\n", kind, dgst, b.Event, progress.Bar(frac),
			progress.Bytes(b.Progress), progress.Bytes(b.Total))
	}
	done, _ := p.totals()
	fmt.Fprintf(tw, "%s\telapsed: %.1fs\ttotal: %s\t(%v)\t\n", p.status, time.Since(p.start).Seconds(),
		progress.Bytes(done), progress.NewBytesPerSecond(done, time.Since(p.start)))
	_ = tw.Flush()
	_ = p.tw.Flush()
}

// finish draws the last state and the outcome.
func (p *pullProgress) finish(err error, took time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err == nil {
		p.status = "done"
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
