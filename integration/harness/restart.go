package harness

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"time"
)

// KillDaemon SIGKILLs containerd, as a crash would, and waits for it to
// exit; its shims and containers live on. StartDaemon brings it back.
func (c *Containerd) KillDaemon() error {
	if c.cmd == nil || c.cmd.Process == nil {
		return fmt.Errorf("harness: containerd was not started by this process")
	}
	select {
	case <-c.exited:
		return nil
	default:
	}
	_ = c.cmd.Process.Kill()
	select {
	case <-c.exited:
	case <-time.After(30 * time.Second):
		return fmt.Errorf("harness: containerd pid %d does not die", c.cmd.Process.Pid)
	}
	c.mu.Lock()
	if c.client != nil {
		c.client.Close()
		c.client = nil
	}
	c.mu.Unlock()
	return nil
}

// StartDaemon starts containerd again (after KillDaemon) with the same
// configuration and waits until it answers; Client then returns a fresh client.
func (c *Containerd) StartDaemon(ctx context.Context) error {
	select {
	case <-c.exited:
	default:
		return fmt.Errorf("harness: containerd still runs")
	}
	bin := c.opts.Containerd
	if bin == "" {
		p, err := exec.LookPath("containerd")
		if err != nil {
			return err
		}
		bin = p
	}
	logf, err := os.OpenFile(c.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(bin, "--config", filepath.Join(c.Dir, "config.toml"))
	cmd.Dir = c.Dir
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = c.daemonEnv()
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("harness: restart containerd: %w", err)
	}
	exited := make(chan struct{})
	c.cmd, c.exited = cmd, exited
	go func() {
		c.waitErr = cmd.Wait()
		close(exited)
	}()
	timeout := c.opts.StartTimeout
	if timeout == 0 {
		timeout = 30 * time.Second
	}
	return c.waitServing(ctx, timeout)
}
