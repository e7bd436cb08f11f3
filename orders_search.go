package main

import (
	"context"
	"fmt"
	"net/http"
	"net/url"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/labstack/echo/v4"
	"github.com/meilisearch/meilisearch-go"
	"github.com/sirupsen/logrus"
)

// searchPoolShare: searches, which may scan, hold at most this share of the
// pool's connections at once (at least one), so no search can starve the
// order path and the workers of connections.
const searchPoolShare = 4

// handleSearchOrders is GET /admin/orders?q= on the ops port, behind the
// admin token: up to 50 whole orders whose customer or SKUs match q, from
// Meilisearch when it answers, else the newest 50 whose customer contains q,
// from SQL. X-Search-Source says which answered. The index is filled by the
// order-indexing job; without q, SQL lists the newest. At most a share of
// the pool searches at once; a search that finds no slot within the
// request's budget is answered 503 with Retry-After.
func handleSearchOrders(db *pgxpool.Pool, search meilisearch.ServiceManager, t timeouts, log *logrus.Entry) echo.HandlerFunc {
	slots := make(chan struct{}, max(1, int(db.Config().MaxConns)/searchPoolShare))
	return func(c echo.Context) error {
		q, err := searchQuery(c)
		if err != nil {
			return err
		}
		ctx, cancel := context.WithTimeout(c.Request().Context(), t.request)
		defer cancel()
		select {
		case slots <- struct{}{}:
			defer func() { <-slots }()
		case <-ctx.Done():
			c.Response().Header().Set("Retry-After", "1")
			return apiError(http.StatusServiceUnavailable, "busy", "too many searches right now; retry shortly")
		}
		if search != nil && q != "" {
			// Meilisearch gets half of the request's budget: past it, SQL answers instead.
			sctx, cancel := context.WithTimeout(ctx, t.search)
			ids, err := searchOrderIDs(sctx, search, q, 50)
			cancel()
			if err == nil {
				orders, err := retrySafe(ctx, db, func(ctx context.Context) ([]order, error) { return ordersByID(ctx, db, ids) })
				if err != nil {
					return err
				}
				c.Response().Header().Set("X-Search-Source", "meilisearch")
				return c.JSON(http.StatusOK, map[string]any{"orders": orders})
			}
			log.WithError(err).Warn("search unavailable, answering from SQL")
		}
		orders, err := retrySafe(ctx, db, func(ctx context.Context) ([]order, error) {
			return collectOrders(db.Query(ctx, `SELECT `+orderColumns+` FROM orders
				WHERE $1 = '' OR strpos(lower(customer), lower($1)) > 0
				ORDER BY id DESC LIMIT 50`, q))
		})
		if err != nil {
			return fmt.Errorf("listing orders: %w", err)
		}
		c.Response().Header().Set("X-Search-Source", "sql")
		return c.JSON(http.StatusOK, map[string]any{"orders": orders})
	}
}

// searchQuery is the q parameter, refused with a 400 naming it unless it is
// text a person could type: echo's QueryParam silently drops a query string
// that is not valid URL encoding, and Postgres answers a NUL or invalid UTF-8
// (q=%00, q=%ff) with an error that was a 500.
func searchQuery(c echo.Context) (string, error) {
	query, err := url.ParseQuery(c.Request().URL.RawQuery)
	if err != nil {
		return "", apiError(http.StatusBadRequest, "invalid_query", "the query string is not valid URL encoding")
	}
	switch qs := query["q"]; {
	case len(qs) == 0:
		return "", nil
	case len(qs) > 1:
		return "", apiError(http.StatusBadRequest, "invalid_query", "q: give it once")
	case utf8.RuneCountInString(qs[0]) > 200:
		return "", apiError(http.StatusBadRequest, "invalid_query", "q: must be at most 200 characters")
	default:
		if problem := textProblem(qs[0]); problem != "" {
			return "", apiError(http.StatusBadRequest, "invalid_query", "q: "+problem)
		}
		return qs[0], nil
	}
}

// ordersByID loads orders by public id in the order of ids (the search
// ranking); ids the database does not know (an index lagging a deletion) are
// left out.
func ordersByID(ctx context.Context, db *pgxpool.Pool, ids []uuid.UUID) ([]order, error) {
	return collectOrders(db.Query(ctx, `SELECT o.id, o.public_id, o.customer, o.items, o.total_cents, o.created_at
		FROM unnest($1::uuid[]) WITH ORDINALITY AS s(id, rank) JOIN orders o ON o.public_id = s.id ORDER BY s.rank`, ids))
}

// ordersIndex is the Meilisearch index of orders.
const ordersIndex = "orders"

// searchOrderIDs asks Meilisearch for the (public) ids of the orders matching
// q, best first.
func searchOrderIDs(ctx context.Context, client meilisearch.ServiceManager, q string, limit int64) ([]uuid.UUID, error) {
	resp, err := client.Index(ordersIndex).Search(ctx, q, &meilisearch.SearchRequest{Limit: limit, AttributesToRetrieve: []string{"id"}})
	if err != nil {
		return nil, err
	}
	var hits []struct {
		ID uuid.UUID `json:"id"`
	}
	if err := resp.Hits.DecodeInto(&hits); err != nil {
		return nil, fmt.Errorf("decoding search hits: %w", err)
	}
	ids := make([]uuid.UUID, len(hits))
	for i, h := range hits {
		ids[i] = h.ID
	}
	return ids, nil
}
