package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// sseFrame is one Server-Sent Event as a client sees it.
type sseFrame struct {
	ID    int64
	Event string
	Data  map[string]any
	Retry int
	At    time.Time // when it arrived
}

// sseClient reads one event stream in the background, like a browser's
// EventSource, collecting the frames it receives.
type sseClient struct {
	t      *testing.T
	cancel context.CancelFunc
	ended  chan struct{} // closed when the stream ends

	mu     sync.Mutex
	frames []sseFrame
	status int
	header http.Header
	body   string // the error body when status is not 200
}

// openSSE connects to base+/api/events, resuming after lastID when it is not 0.
func openSSE(t *testing.T, base string, lastID int64) *sseClient {
	t.Helper()
	return openSSEWith(t, http.DefaultClient, base, lastID)
}

// openSSEWith is openSSE through client (e.g. one bound to another source address).
func openSSEWith(t *testing.T, client *http.Client, base string, lastID int64) *sseClient {
	t.Helper()
	header := ""
	if lastID != 0 {
		header = strconv.FormatInt(lastID, 10)
	}
	return openSSEHeader(t, client, base, header)
}

// openSSEHeader opens the stream with Last-Event-ID set to lastEventID as
// given ("0" included), or without the header when it is empty.
func openSSEHeader(t *testing.T, client *http.Client, base, lastEventID string) *sseClient {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c := &sseClient{t: t, cancel: cancel, ended: make(chan struct{})}
	t.Cleanup(func() { cancel(); <-c.ended })
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+"/api/events", nil)
	if lastEventID != "" {
		req.Header.Set("Last-Event-ID", lastEventID)
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("opening the event stream at %s: %v", base, err)
	}
	c.status, c.header = resp.StatusCode, resp.Header
	if resp.StatusCode != http.StatusOK {
		raw, _ := io.ReadAll(resp.Body)
		c.body = string(raw)
		resp.Body.Close()
		close(c.ended)
		return c
	}
	go c.read(resp)
	return c
}

func (c *sseClient) read(resp *http.Response) {
	defer close(c.ended)
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	var f sseFrame
	for sc.Scan() {
		line := sc.Text()
		field, value, _ := strings.Cut(line, ":")
		value = strings.TrimPrefix(value, " ")
		switch {
		case line == "":
			if f.Event != "" || f.Data != nil {
				f.At = time.Now()
				c.mu.Lock()
				c.frames = append(c.frames, f)
				c.mu.Unlock()
			}
			f = sseFrame{}
		case field == "id":
			f.ID, _ = strconv.ParseInt(value, 10, 64)
		case field == "event":
			f.Event = value
		case field == "retry":
			f.Retry, _ = strconv.Atoi(value)
		case field == "data":
			f.Data = map[string]any{}
			_ = json.Unmarshal([]byte(value), &f.Data)
		}
	}
}

// events returns the frames of type eventType received so far.
func (c *sseClient) events(eventType string) []sseFrame {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []sseFrame
	for _, f := range c.frames {
		if f.Event == eventType {
			out = append(out, f)
		}
	}
	return out
}

// waitFor waits until cond holds for the frames received, or fails.
func (c *sseClient) waitFor(timeout time.Duration, what string, cond func([]sseFrame) bool) {
	c.t.Helper()
	var n int
	if !poll(timeout, 5*time.Millisecond, func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		n = len(c.frames)
		return cond(c.frames)
	}) {
		c.t.Fatalf("event stream: %s not seen within %s (%d frames)", what, timeout, n)
	}
}

// lastID is the id of the last event received (what EventSource would resume from).
func (c *sseClient) lastID() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := len(c.frames) - 1; i >= 0; i-- {
		if c.frames[i].ID != 0 {
			return c.frames[i].ID
		}
	}
	return 0
}
