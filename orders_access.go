package main

import (
	"context"
	"crypto/hmac"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/labstack/echo/v4"
)

// Who may read an order. The API port is public and the demo has no customer
// accounts, so reading an order needs a capability: the read token its
// POST answered. An order's id is a name, not a credential — it may travel
// (a URL in a support ticket, a log line), and the event stream, which anyone
// can read, never carries it. Operators read and search every order on the
// ops port, behind the admin token; the admin token is not accepted on the
// API port, so a leaked one is worth nothing from where the public comes.
//
// The read token is an HMAC of the order's public id under the master key
// (secrets.go), not a random value stored hashed in the row:
//   - a POST retried with its Idempotency-Key is answered exactly as the
//     first time, token included; a random token, stored only as a hash,
//     could not be answered again to the client whose first answer was lost
//     — the very client the retry is for;
//   - a token is checked before the database is asked, so a wrong one costs
//     no query and tells nothing about whether the order exists;
//   - it grants nothing new to a holder of the master key, who can already
//     open every sealed receipt, whole orders included.
// The price: tokens cannot be revoked one by one, and replacing the master
// key invalidates every token given out before.

// readTokenPurpose keeps read tokens apart from anything else the master key
// authenticates. A new version of the token is a new purpose.
const readTokenPurpose = "order read token v1"

// readToken is the capability to read order id: 43 URL-safe characters.
func readToken(k *masterKey, id uuid.UUID) string {
	return base64.RawURLEncoding.EncodeToString(k.mac(readTokenPurpose, id[:]))
}

// validReadToken reports whether token reads order id, in constant time.
func validReadToken(k *masterKey, id uuid.UUID, token string) bool {
	got, err := base64.RawURLEncoding.DecodeString(token)
	return err == nil && hmac.Equal(got, k.mac(readTokenPurpose, id[:]))
}

// canonicalOrderID reads an order id written the one way the API writes it:
// lowercase hex in the dashed 8-4-4-4-12 form. uuid.Parse also takes upper
// case, braces, "urn:uuid:" and no dashes; each would be a second name for
// the same order (for caches, logs and rate limits alike), so they name no
// order here.
func canonicalOrderID(s string) (uuid.UUID, bool) {
	id, err := uuid.Parse(s)
	return id, err == nil && id.String() == s
}

// errNoOrder answers an id that names no order the caller may read.
var errNoOrder = apiError(http.StatusNotFound, "not_found", "no such order")

// handleGetOrder is GET /api/orders/:id with Authorization: Bearer <readToken>.
// The token travels in the header, never in the URL: URLs end up in access
// logs, browser history and Referer headers (RFC 6750 §5.3). An id that is
// not canonical is 404 before anything else; a missing or wrong token is
// 401, whether or not the order exists.
func handleGetOrder(db *pgxpool.Pool, key *masterKey, t timeouts) echo.HandlerFunc {
	return func(c echo.Context) error {
		id, ok := canonicalOrderID(c.Param("id"))
		if !ok {
			return errNoOrder
		}
		token, ok := bearerToken(c.Request())
		if !ok || !validReadToken(key, id, token) {
			c.Response().Header().Set(echo.HeaderWWWAuthenticate, `Bearer error="invalid_token"`)
			return apiError(http.StatusUnauthorized, "unauthorized",
				"reading an order needs Authorization: Bearer <readToken>, the token its POST /api/orders answered")
		}
		return answerOrder(c, db, t, id)
	}
}

// handleAdminGetOrder is GET /admin/orders/:id on the ops port, behind the
// admin token: any order, for an operator.
func handleAdminGetOrder(db *pgxpool.Pool, t timeouts) echo.HandlerFunc {
	return func(c echo.Context) error {
		id, ok := canonicalOrderID(c.Param("id"))
		if !ok {
			return errNoOrder
		}
		return answerOrder(c, db, t, id)
	}
}

// answerOrder answers the whole order id. Personal data: no cache may keep it.
func answerOrder(c echo.Context, db *pgxpool.Pool, t timeouts, id uuid.UUID) error {
	ctx, cancel := context.WithTimeout(c.Request().Context(), t.request)
	defer cancel()
	o, err := retrySafe(ctx, db, func(ctx context.Context) (order, error) { return orderByPublicID(ctx, db, id) })
	if errors.Is(err, pgx.ErrNoRows) {
		return errNoOrder
	}
	if err != nil {
		return fmt.Errorf("loading order %s: %w", id, err)
	}
	c.Response().Header().Set(echo.HeaderCacheControl, "no-store")
	return c.JSON(http.StatusOK, o)
}
